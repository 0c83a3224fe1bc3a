"""The router's live deployment page (`GET /dashboard`): see feed.py for where its numbers come from."""

from server.dashboard.feed import Dashboard, dashboard_routes

__all__ = ["Dashboard", "dashboard_routes"]
