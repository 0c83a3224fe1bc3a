"""The router's live deployment page (`GET /dashboard`): see feed.py for where its numbers come from."""
