import os

import freetoken


def test_get_include_holds_handoff_header():
    assert os.path.isfile(os.path.join(freetoken.get_include(), "freetoken", "handoff.h"))
