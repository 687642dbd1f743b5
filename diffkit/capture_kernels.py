"""Kernels capture sees besides torch's own ops: functions of C++/CUDA extensions (``load_inline`` / ``load``,
found by `_is_extension_function`, registered as they are imported by a watch on cpp_extension's importer) and
user-launched Triton kernels.  For a capture's duration their calls go through recording wrappers
(`_ExtensionPatch`, `_TritonPatch`), which hand what the call did to the capture's state (`on_ext`, `on_writes`)."""
from __future__ import annotations

import sys
import types
import warnings
import weakref
from typing import Any, Callable

import torch

from . import naming

_EXTENSIONS: "weakref.WeakSet[types.ModuleType]" = weakref.WeakSet()

_NOT_EXTENSIONS = {"torch", "numpy", "triton", "pandas", "matplotlib", "scipy"}


def register_extension(module: types.ModuleType) -> types.ModuleType:
    """Make an extension module known to capture (done automatically for load_inline/load)."""
    _EXTENSIONS.add(module)
    return module


_CPP_EXTENSION = "torch.utils.cpp_extension"


def _install_extension_import_hook() -> None:
    """Wrap cpp_extension's importer so every extension loaded from now on is registered: at once when
    cpp_extension is imported already, else the moment something imports it (`_ExtensionImportWatch`).
    Importing it brings setuptools along (~0.08 s): a diff of models with no extension never pays that."""
    ce = sys.modules.get(_CPP_EXTENSION)
    if ce is not None:
        _wrap_extension_importer(ce)
    elif not any(isinstance(f, _ExtensionImportWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _ExtensionImportWatch())


def _wrap_extension_importer(ce: types.ModuleType) -> None:
    original = getattr(ce, "_import_module_from_library", None)
    if original is None or getattr(original, "_diffkit", False):
        return

    def _import_module_from_library(*args, **kwargs):
        module = original(*args, **kwargs)
        try:
            register_extension(module)
        except TypeError:
            pass
        return module

    _import_module_from_library._diffkit = True  # type: ignore[attr-defined]
    ce._import_module_from_library = _import_module_from_library


class _ExtensionImportWatch:
    """A finder first on sys.meta_path that answers for torch.utils.cpp_extension only: the spec the finders
    after it give, its loader wrapped (`_WrappingLoader`) so that the module, once executed, gets its importer
    wrapped (`_wrap_extension_importer`).  It stays there (one string compared an import): a lookup that imports
    nothing (`importlib.util.find_spec`) or an import that fails leaves it for the next one, and no finder is
    removed while an import walks the list."""

    def find_spec(self, name, path, target=None):
        if name != _CPP_EXTENSION:
            return None
        for finder in list(sys.meta_path):
            if isinstance(finder, _ExtensionImportWatch):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _WrappingLoader(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        pass


class _WrappingLoader:
    """A module's loader, its `exec_module` followed by `_wrap_extension_importer`; everything else the loader's
    own (source, code, resources)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def create_module(self, spec):
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _wrap_extension_importer(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _is_extension_function(obj: Any) -> bool:
    """A builtin function from a compiled module that is neither Python's nor torch's.

    load_inline/load modules are not put in sys.modules, so a function whose module is not
    importable by name, or is a compiled extension module, qualifies."""
    if not isinstance(obj, types.BuiltinFunctionType):
        return False
    modname = getattr(obj, "__module__", None)
    top = (modname or "").split(".")[0]
    if not modname or modname in sys.builtin_module_names or top in _NOT_EXTENSIONS or top == "builtins" \
            or top in getattr(sys, "stdlib_module_names", ()):
        return False
    mod = sys.modules.get(modname)
    return mod is None or _looks_like_extension(mod)


def _looks_like_extension(mod: Any) -> bool:
    if not isinstance(mod, types.ModuleType):
        return False
    if mod in _EXTENSIONS:
        return True
    f = getattr(mod, "__file__", None) or ""
    top = mod.__name__.split(".")[0]
    if not f.endswith((".so", ".pyd")) or top in _NOT_EXTENSIONS or top in getattr(sys, "stdlib_module_names", ()):
        return False
    return any(isinstance(v, types.BuiltinFunctionType) for v in vars(mod).values())


class _ExtensionPatch:
    """Swap extension functions for recording wrappers for the duration of a capture."""

    def __init__(self, state: Any, run_kernel: Callable):
        self.state = state
        self.run_kernel = run_kernel  # `capture._launch`: calls a kernel, naming it as the failing call if it raises
        self.undo: list[tuple[dict, str, Any]] = []
        self.wrapped: dict[int, Callable] = {}
        self._scanned: tuple[list[dict], list[types.ModuleType]] | None = None

    def _wrap(self, fn, qualname: str):
        w = self.wrapped.get(id(fn))
        if w is not None:
            return w
        st, run_kernel = self.state, self.run_kernel

        def wrapper(*args, **kwargs):
            st.before_write(args, kwargs)  # a kernel may write into any tensor it is given
            if st.busy or st.opaque:
                return fn(*args, **kwargs)
            before = None
            if st.returns_none.get(qualname, True) and not st.may_fold(args):
                st.busy = True
                try:
                    before = [(i, a.detach().clone()) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
                finally:
                    st.busy = False
            out = run_kernel(st, f"ext:{qualname}", fn, args, kwargs)
            st.returns_none[qualname] = out is None
            st.busy = True
            try:
                st.on_ext(qualname, fn, args, kwargs, out, before)
            except Exception as e:
                if not st.warned:
                    st.warned = True
                    warnings.warn(f"diffkit: could not record extension call {qualname}: {e}")
            finally:
                st.busy = False
            return out

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(fn, "__name__", "ext")
        wrapper._diffkit_qualname = qualname  # type: ignore[attr-defined]
        self.wrapped[id(fn)] = wrapper
        return wrapper

    def _set(self, namespace: dict, key: str, value: Any) -> None:
        self.undo.append((namespace, key, namespace[key]))
        namespace[key] = value

    def _model_scan(self, model: torch.nn.Module | None) -> tuple[list[dict], list[types.ModuleType]]:
        """The source namespaces of the model's forward methods and the modules its submodules hold:
        read once per capture (a capture suspended and resumed mid-forward installs again)."""
        if self._scanned is None:
            namespaces: list[dict] = []
            seen: set[int] = set()
            held: list[types.ModuleType] = []
            if model is not None:
                for m in model.modules():
                    for klass in type(m).__mro__:
                        fwd = klass.__dict__.get("forward")
                        g = getattr(fwd, "__globals__", None)
                        if g is not None and id(g) not in seen and not g.get("__name__", "").startswith("torch"):
                            seen.add(id(g))
                            namespaces.append(g)
                    for v in vars(m).values():
                        if isinstance(v, types.ModuleType):
                            held.append(v)
            self._scanned = (namespaces, held)
        return self._scanned

    def install(self, model: torch.nn.Module | None) -> None:
        namespaces, held = self._model_scan(model)
        modules: list[types.ModuleType] = list(_EXTENSIONS) + held
        for g in namespaces:
            for v in list(g.values()):
                if isinstance(v, types.ModuleType):
                    modules.append(v)
        done: set[int] = set()
        originals: dict[int, Callable] = {}
        for mod in modules:
            if id(mod) in done or not _looks_like_extension(mod):
                continue
            done.add(id(mod))
            ns = vars(mod)
            for key, fn in list(ns.items()):
                if key.startswith("_") or not isinstance(fn, types.BuiltinFunctionType):
                    continue
                originals[id(fn)] = fn
                self._set(ns, key, self._wrap(fn, f"{mod.__name__}.{key}"))
        # names bound with `from ext import fn`, in the model's source modules
        for g in namespaces:
            for key, v in list(g.items()):
                if isinstance(v, types.BuiltinFunctionType) and (id(v) in originals or _is_extension_function(v)):
                    self._set(g, key, self._wrap(v, f"{getattr(v, '__module__', None) or 'ext'}.{key}"))

    def remove(self) -> None:
        for ns, key, old in reversed(self.undo):
            ns[key] = old
        self.undo.clear()


class _TritonPatch:
    """Record user-launched Triton kernels: ``kernel[grid](...)`` is wrapped for the capture's duration.

    The wrapper sits on ``KernelInterface.__getitem__``, the user-facing launch: an autotuner or
    heuristics wrapper launches its inner kernel through ``run`` directly (benchmarking configs
    included), so each user launch is recorded once.  Triton kernels return nothing; the tensor
    arguments whose contents the launch changed are recorded (kind ``write``), each named by its
    argument's source text at the call site, like any variable assigned there."""

    def __init__(self, state: Any, run_kernel: Callable, active: list):
        self.state = state
        self.run_kernel = run_kernel  # (as `_ExtensionPatch`'s)
        self.active = active  # the captures' states, innermost last (`capture._ACTIVE`)
        self.undo: Any = None

    def install(self) -> None:
        jit = sys.modules.get("triton.runtime.jit")
        ki = getattr(jit, "KernelInterface", None) if jit is not None else None
        if ki is None or "__getitem__" not in vars(ki):
            return
        original = vars(ki)["__getitem__"]
        st, run_kernel, active = self.state, self.run_kernel, self.active

        def __getitem__(kernel, grid):
            launch = original(kernel, grid)
            if st.busy or st.opaque or active[-1:] != [st]:
                return launch
            name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")

            def run(*args, **kwargs):
                if st.busy:
                    return launch(*args, **kwargs)
                st.before_write(args, kwargs)  # a kernel may write into any tensor it is given
                st.busy = True  # also the re-entrancy guard: nested launches are the same user launch
                try:
                    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
                    f = naming.user_frame(sys._getframe(1))
                    if st.fold is not None:
                        # folded: every tensor argument not a parameter may be what it wrote
                        written = st.non_param_tensors(args)
                        if st.foldable(written, f, write=True):
                            out = run_kernel(st, f"triton:{name}", launch, args, kwargs)
                            st.fold_into(written, st.lineage_of((args, kwargs)), in_place=True, frame=f,
                                         op=f"triton:{name}", known=False)
                            return out
                    before = [(i, a.detach().clone()) for i, a in tensors]
                    out = run_kernel(st, f"triton:{name}", launch, args, kwargs)
                    site = naming.site_of(f) if f is not None else naming.UNKNOWN_SITE
                    _, refs, params = st.template((args, kwargs))
                    st.on_writes(site, f"triton:{name}", args, before, ("triton", None, None), refs, params)
                    return out
                finally:
                    st.busy = False

            return run

        ki.__getitem__ = __getitem__
        self.undo = (ki, original)

    def remove(self) -> None:
        if self.undo is not None:
            ki, original = self.undo
            ki.__getitem__ = original
            self.undo = None
