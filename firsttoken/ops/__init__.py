"""The operator's view: `GET /ops`, its feed `GET /v1/admin/events`, what they read."""

from firsttoken.ops.view import OpsView

__all__ = ["OpsView"]
