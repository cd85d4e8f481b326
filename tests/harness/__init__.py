"""Shared test harnesses: helpers, worker modules, scripts and actors that tests in ``tests/unit`` and
``tests/e2e`` import or run. No tests here; fixtures stay in ``tests/conftest.py``."""
