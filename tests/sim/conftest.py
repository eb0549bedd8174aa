import os

import pytest

PHILLY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "philly.csv")


@pytest.fixture
def philly_path():
    path = os.path.abspath(PHILLY)
    if not os.path.exists(path):
        pytest.skip("../shared/data/philly.csv not present")
    return path
