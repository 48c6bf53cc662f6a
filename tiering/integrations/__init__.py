"""Adapters to serving engines (optional extras; importing `tiering` imports none of them).

Thread: see each adapter.
"""
