"""Version lock-step between freetoken-core and the packages built against it.

The FreeToken distributions (``freetoken``, ``freetoken-core``, ``freetoken-cpu-moe``,
``freetoken-cuda``, ``freetoken-rocm``) are released together with one version: the
native packages compile against the C layouts of the core they were built with, so
a mixed install can publish wrong data. Each of them calls
:func:`require_core_version` when it is imported, and the backend registry checks
the installed metadata of every lock-step distribution before it loads a plugin.

Third-party backends are not in lock-step; they declare the contract version they
implement (``Backend.api_version``) instead.
"""

from __future__ import annotations

from freetoken._version import __version__ as CORE_VERSION

#: Distributions released in lock-step with freetoken-core.
LOCKSTEP_DISTRIBUTIONS = frozenset(
    {"freetoken", "freetoken-core", "freetoken-cpu-moe", "freetoken-cuda", "freetoken-rocm"}
)

#: How a user installs a matching version of each lock-step distribution.
_INSTALL_SPEC = {
    "freetoken": "freetoken",
    "freetoken-core": "freetoken",
    "freetoken-cpu-moe": "freetoken",
    "freetoken-cuda": "freetoken[cuda]",
    "freetoken-rocm": "freetoken[rocm]",
}


class VersionMismatchError(ImportError):
    """A FreeToken package and the installed freetoken-core have different versions."""


def normalize_distribution_name(name: str) -> str:
    """PEP 503 normalisation, so ``freetoken_cuda`` and ``FreeToken-CUDA`` compare equal."""
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def install_command(distribution: str, version: str = CORE_VERSION) -> str:
    """The pip command that installs ``distribution`` at ``version`` with a matching core."""
    spec = _INSTALL_SPEC.get(normalize_distribution_name(distribution), distribution)
    return f"pip install '{spec}=={version}'"


def mismatch_message(distribution: str, version: str, core_version: str = CORE_VERSION) -> str:
    """The error text for ``distribution`` at ``version`` next to ``core_version``."""
    return (
        f"{distribution} {version} does not match freetoken-core {core_version}: FreeToken packages "
        f"must all have the same version. Reinstall them together, e.g. "
        f"`{install_command(distribution, core_version)}`."
    )


def lockstep_error(distribution: str, version: str, core_version: str = CORE_VERSION) -> str | None:
    """The mismatch message when ``distribution`` is lock-step and its version differs, else None."""
    if normalize_distribution_name(distribution) not in LOCKSTEP_DISTRIBUTIONS:
        return None
    if version == core_version:
        return None
    return mismatch_message(distribution, version, core_version)


def require_core_version(distribution: str, version: str, core_version: str | None = None) -> None:
    """Raise :class:`VersionMismatchError` unless ``version`` equals freetoken-core's.

    Every FreeToken package calls this at import time with its own name and version::

        from freetoken.versioning import require_core_version
        __version__ = "0.1.0"
        require_core_version("freetoken-cuda", __version__)
    """
    if core_version is None:
        import freetoken  # the installed core, read at call time

        core_version = freetoken.__version__
    if version != core_version:
        raise VersionMismatchError(mismatch_message(distribution, version, core_version))
