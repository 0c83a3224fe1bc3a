"""Makes packages look uninstalled to this interpreter: `install(names)` puts a finder first on
sys.meta_path that answers "no such module" for them and their submodules, as a Python without them
would (an `import` raises ModuleNotFoundError, `importlib.util.find_spec` returns None).

The serving install (`pip install pdserve`, no extras) has none of the test and bench packages:
tests/unit/test_serving_imports.py and tests/integration/test_first_hour.py run pdserve with them
blocked. Usable from `python -c`: `import import_blocker; import_blocker.install()`."""

from __future__ import annotations

import importlib.abc
import sys

# the test, bench, ray and cuda extras of pyproject.toml, by import name
NOT_FOR_SERVING = ("pytest", "xdist", "hypothesis", "openai", "ruff", "selenium", "triton", "matplotlib",
                   "schemathesis", "psutil", "lm_eval", "ray")


class Blocker(importlib.abc.MetaPathFinder):
    """Stands in for every finder of sys.meta_path: asks them for anything but the blocked names."""

    def __init__(self, names: tuple[str, ...], finders: list) -> None:
        self.names, self.finders = set(names), finders
        self.asked: list[str] = []  # blocked imports that were tried (an optional import may try one)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            self.asked.append(fullname)
            return None
        for finder in self.finders:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                return spec
        return None

    def find_distributions(self, *args, **kwargs):
        """importlib.metadata's question: the installed distributions, less the blocked ones."""
        for finder in self.finders:
            for dist in finder.find_distributions(*args, **kwargs) if hasattr(finder, "find_distributions") else ():
                if (dist.metadata["Name"] or "").lower().replace("-", "_") not in self.names:
                    yield dist

    def invalidate_caches(self) -> None:
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()


def install(names: tuple[str, ...] = NOT_FOR_SERVING) -> Blocker:
    loaded = sorted(n for n in sys.modules if n.partition(".")[0] in names)
    assert not loaded, f"already imported: {loaded}"
    blocker = Blocker(names, list(sys.meta_path))
    sys.meta_path[:] = [blocker]
    return blocker
