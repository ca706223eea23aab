"""Load a TrainSpec from its reference: `package.module:function` or `path/to/file.py:function`.

Contract: `resolve(ref)` imports the factory (SpecError naming the module or attribute and the import error);
`build_spec(ref, args, ...)` calls it with the spec arguments — plus `run_config` (the run's Config) and
`files` (the run's spec files in the bucket) when its signature asks for them — and checks it returned a
TrainSpec. `reference_of(fn)` turns a module-level function into a reference another process can import.
Only learners, the evaluator and the run's creator load a spec; the merger, audit and gc never do.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from diloco.training.spec import SpecError, TrainSpec

DEFAULT_SPEC = "diloco.specs.gpt:make_spec"
INJECTED = ("run_config", "files")  # what the engine passes to a factory that asks for it


def _split(ref: str) -> tuple[str, str]:
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
        raise SpecError(f"spec {ref!r} must be 'package.module:function' or 'path/to/file.py:function'")
    module, attr = ref.split(":")
    return module, attr


def _import_file(path: str) -> Any:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise SpecError(f"spec file {path!r} does not exist")
    name = "diloco_user_spec_" + hashlib.sha256(str(file).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - user code: any error while importing it is the user's to see
        del sys.modules[name]
        raise SpecError(f"spec file {path!r} could not be imported: {type(err).__name__}: {err}") from err
    return module


def resolve(ref: str) -> Callable[..., TrainSpec]:
    """The factory a reference names; SpecError saying which module or attribute and why."""
    module_name, attr = _split(ref)
    if module_name.endswith(".py") or "/" in module_name:
        module = _import_file(module_name)
    else:
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # noqa: BLE001 - user code: report any import failure in one line
            raise SpecError(f"spec module {module_name!r} could not be imported: "
                            f"{type(err).__name__}: {err}") from err
    factory = getattr(module, attr, None)
    if factory is None:
        raise SpecError(f"spec {ref!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise SpecError(f"spec {ref!r}: {attr!r} is a {type(factory).__name__}, not a function")
    return factory


def absolute(ref: str) -> str:
    """A file reference with its path made absolute (other processes may run elsewhere); others unchanged."""
    module, attr = _split(ref)
    if module.endswith(".py") or "/" in module:
        return f"{Path(module).expanduser().resolve()}:{attr}"
    return ref


def _installed(module: str) -> bool:
    """Whether a fresh interpreter finds `module` by name: diloco's own, or a file under site-packages."""
    if module.split(".")[0] == "diloco":
        return True
    file = getattr(sys.modules.get(module), "__file__", None) or ""
    return any(part in ("site-packages", "dist-packages") for part in Path(file).parts)


def reference_of(factory: Callable[..., Any] | str) -> str:
    """The reference of a module-level function — its module for an installed package, else its file (a
    script, a file beside it, a test file: other processes import it by path) — or a string as given."""
    if isinstance(factory, str):
        return absolute(factory)
    name = getattr(factory, "__qualname__", "")
    module = getattr(factory, "__module__", None)
    if not callable(factory) or not name or "<" in name or "." in name or module is None:
        raise SpecError(f"spec {factory!r} must be a module-level function (or its 'module:function' string)")
    if _installed(module):
        return f"{module}:{name}"
    return f"{Path(inspect.getfile(factory)).resolve()}:{name}"


def parse_spec_args(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs (values parsed as YAML scalars) -> dict; SpecError naming a malformed pair."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise SpecError(f"--spec-arg {pair!r} must be key=value with key a Python identifier")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as err:
            raise SpecError(f"--spec-arg {pair!r}: the value is not a YAML scalar: {err}") from None
        if isinstance(value, dict | list):
            raise SpecError(f"--spec-arg {pair!r}: the value must be a scalar (number, string, bool, null)")
        out[key] = value
    return out


def build_spec(ref: str, args: dict[str, Any] | None = None, *, run_config: Any = None,
               files: Any = None) -> TrainSpec:
    """Call the factory with `args` (and what it asks for of run_config/files); SpecError on anything
    wrong."""
    factory = resolve(ref)
    args = dict(args or {})
    clash = sorted(set(args) & set(INJECTED))
    if clash:
        raise SpecError(f"spec_args may not set {clash[0]!r}: the engine passes it")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    for name, value in (("run_config", run_config), ("files", files)):
        if name in params:
            args[name] = value
    try:
        spec = factory(**args)
    except SpecError:
        raise
    except TypeError as err:
        raise SpecError(f"spec {ref!r} does not take these arguments {sorted(args)}: {err}") from err
    if not isinstance(spec, TrainSpec):
        raise SpecError(f"spec {ref!r} returned a {type(spec).__name__}, not a diloco.TrainSpec")
    return spec
