import os
import sys

import pytest


def _install_standin() -> None:
    import freetoken_cpu_moe

    if hasattr(freetoken_cpu_moe, "moe_forward"):
        return
    import _torch_cm

    sys.modules["freetoken_cpu_moe"] = _torch_cm


sys.path.insert(0, os.path.dirname(__file__))
_install_standin()


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ftcache"))
