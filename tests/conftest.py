import warnings

import pytest


@pytest.fixture(autouse=True)
def _quiet():
    # transformers and MemTracker warn about things that do not matter to memory tests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
