"""Routes: many engines behind one gateway, with health, phase deadlines and the splice."""

from firsttoken.routing.build import build_engine, build_routes, routes_in, shorthand
from firsttoken.routing.config import ModelRoute, RoutesError, RouteTable, TargetConfig, load_routes
from firsttoken.routing.engine import RoutedEngine

__all__ = [
    "ModelRoute",
    "RouteTable",
    "RoutedEngine",
    "RoutesError",
    "TargetConfig",
    "build_engine",
    "build_routes",
    "load_routes",
    "routes_in",
    "shorthand",
]
