import pytest

from megakernel import cpu_backend


@pytest.fixture(scope="session", autouse=True)
def _shared_worker_pool():
    """Worker processes cost seconds to start: every test shares the default pool, stopped at the end."""
    yield
    cpu_backend.shutdown()
