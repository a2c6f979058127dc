"""Stored conversations (`firsttoken/api/responses/conversation.py`) without a server: the
input as the items input_items lists (ids, content as parts), and its pages (limit, order,
after) with a 400 naming each bad parameter."""

from __future__ import annotations

import pytest

from firsttoken.api.responses.conversation import _page, stored_items
from firsttoken.api.responses.protocol import ResponsesRequest
from firsttoken.formats.errors import APIError


def own(**body: object) -> list:
    request = ResponsesRequest.model_validate(body)
    return request.input if isinstance(request.input, str) else list(request.input)


def test_a_string_input_is_one_user_message_with_an_id() -> None:
    (item,) = stored_items(own(input="hello"), "s1")
    assert item == {
        "id": "msg_s1_in0",
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "hello"}],
        "status": "completed",
    }


def test_items_keep_their_ids_and_get_one_by_kind_and_place() -> None:
    items = stored_items(
        own(
            input=[
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "f",
                    "arguments": "{}",
                    "id": "fc_own",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ]
        ),
        "s2",
    )
    assert [i["id"] for i in items] == ["msg_s2_in0", "msg_s2_in1", "fc_own", "fco_s2_in3"]
    assert items[1]["content"] == [{"type": "output_text", "text": "a"}]  # the assistant's
    assert items[3]["output"] == "42"


ITEMS = [{"id": f"msg_{n}"} for n in range(5)]


def test_pages_are_desc_by_default_and_follow_after() -> None:
    first = _page(ITEMS, {"limit": "2"})
    assert [i["id"] for i in first["data"]] == ["msg_4", "msg_3"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("msg_4", "msg_3", True)
    last = _page(ITEMS, {"limit": "2", "after": "msg_1"})
    assert [i["id"] for i in last["data"]] == ["msg_0"] and last["has_more"] is False
    asc = _page(ITEMS, {"order": "asc", "after": "msg_2"})
    assert [i["id"] for i in asc["data"]] == ["msg_3", "msg_4"]
    empty = _page([], {})
    assert empty == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "²"}, "limit"),
        ({"order": "newest"}, "order"),
        ({"after": "msg_9"}, "after"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(query: dict[str, str], param: str) -> None:
    with pytest.raises(APIError) as info:
        _page(ITEMS, query)
    assert info.value.status == 400 and info.value.param == param
