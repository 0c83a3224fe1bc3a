"""The router's live deployment page (`GET /dashboard`): see feed.py for where its numbers come from."""

from server.router.dashboard.feed import Dashboard
from server.router.dashboard.routes import dashboard_routes

__all__ = ["Dashboard", "dashboard_routes"]
