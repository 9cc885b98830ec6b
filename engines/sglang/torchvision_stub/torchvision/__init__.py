"""An import-only stand-in for torchvision in .venv-sglang (installed by engines/sglang/setup.sh).

SGLang 0.5.23 imports torchvision while loading its model configs (``srt/configs`` ->
``multimodal/internvl_utils.py``); the disaggregation transfer path the kvlease adapter tests run
never calls it, and PyPI's torchvision does not load beside the CPU torch build. Every
``torchvision.*`` module imports; every name in it is a placeholder that raises when used, so a
code path that really needs torchvision fails loudly instead of computing something wrong.
The package has no distribution metadata, so ``transformers`` reports torchvision as absent.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+kvlease.stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"torchvision stand-in: {self._name} is not available in .venv-sglang")

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "InterpolationMode":
            return InterpolationMode
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())


def __getattr__(attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    import importlib

    try:
        return importlib.import_module(f"torchvision.{attr}")
    except ImportError:
        return _Placeholder(f"torchvision.{attr}")
