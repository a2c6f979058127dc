import pytest
from starlette.requests import Request

from firsttoken.admission.admin import AdminKey
from firsttoken.formats.errors import APIError


def _request(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "GET", "path": "/ops", "headers": headers})


def test_the_admin_key_lets_its_holder_in():
    admin = AdminKey("s3cret")
    assert admin.allows(_request("Bearer s3cret"))
    admin.check(_request("bearer  s3cret "))


@pytest.mark.parametrize("authorization", [None, "", "Bearer ", "Bearer s3cre", "s3cret"])
def test_anything_else_is_not_found(authorization):
    with pytest.raises(APIError) as raised:
        AdminKey("s3cret").check(_request(authorization))
    assert (raised.value.status, raised.value.code) == (404, "not_found")


def test_without_an_admin_key_nothing_gets_in():
    admin = AdminKey(None)
    assert not admin.configured
    assert not admin.allows(_request("Bearer "))
    assert not admin.allows(_request("Bearer anything"))


def test_from_env_names_a_missing_variable(monkeypatch):
    monkeypatch.delenv("FT_TEST_ADMIN", raising=False)
    with pytest.raises(ValueError, match="FT_TEST_ADMIN"):
        AdminKey.from_env("FT_TEST_ADMIN")
    monkeypatch.setenv("FT_TEST_ADMIN", "k")
    assert AdminKey.from_env("FT_TEST_ADMIN").allows(_request("Bearer k"))
    assert not AdminKey.from_env(None).configured
