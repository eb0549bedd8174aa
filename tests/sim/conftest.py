import os

import pytest

# The Philly trace beside the checkout (../shared/data/philly.csv); GPUSWAP_TEST_PHILLY names
# another copy (a second worktree has no ../shared of its own).
PHILLY = os.environ.get("GPUSWAP_TEST_PHILLY") or os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "shared", "data", "philly.csv")


@pytest.fixture(scope="session")
def philly_path():
    path = os.path.abspath(PHILLY)
    if not os.path.exists(path):
        pytest.skip("../shared/data/philly.csv not present")
    return path
