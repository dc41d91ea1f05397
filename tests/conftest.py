import harness
import pytest


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Worker pools live for the whole session (see harness.py); close them at the end."""
    yield
    harness.shutdown()
