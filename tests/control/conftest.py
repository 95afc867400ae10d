"""The job executor rig (je_rig.py) as a fixture."""

import pytest

from tests.control.je_rig import make_rig


@pytest.fixture
def rig(tiny_model):
    yield from make_rig(tiny_model)
