"""Score and mask mods (host only: no CuTe-DSL import): the compile-key record of a call's ``score_mod``,
``score_mod_bwd``, ``mask_mod`` and ``aux_tensors``, and the checks that run before any launch.

Call convention (upstream flash-attn-4 4.0.0b36's, so a mod written for it works unchanged):

    @cute.jit
    def score_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors) -> score'
    @cute.jit
    def score_mod_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors) -> d score
    @cute.jit
    def mask_mod(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors) -> keep (Boolean)

``score`` is a TensorSSA of raw q.k times ``softmax_scale`` (fp32); the indices are Int32 TensorSSAs of the same
length (``score_mod.__vec_size__`` keys of one row: 2 by default, 1 when aux tensors are given; mask_mod gets 1):
batch entry, query head, query position in its sequence, key position in its sequence (varlen, packed GQA, paged
and split-KV calls see the same logical indices).  ``seqlen_info`` has ``offset_q``, ``offset_k`` (first row of
the sequence in a varlen tensor, else 0), ``seqlen_q``, ``seqlen_k``.  ``aux_tensors`` is the tuple of the call's
aux tensors (device tensors of rank >= 1); indices past the ends of a sequence are clamped to its last position
when aux tensors are present, so a mod that indexes one by position never reads outside it.

Compile key: each mod enters by its module, qualified name, a hash of its source and the values of its closure
cells and defaults (by value when hashable, else by identity), so a new mod compiles once and a repeated one (or
an equal closure made again) never recompiles.  Aux tensors enter by dtype and rank only.  Mods defined outside
this package are compiled in memory only (their source can change without this package's fingerprint
changing); the library mods (kernels/mods.py) use the disk cache.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass, field

import torch

from .compat import refuse

_AUX_DTYPES = {torch.float32: "fp32", torch.int32: "i32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.int64: "i64"}
MAX_AUX_TENSORS = 8


def _value_key(v, depth: int = 0):
    if callable(v) and depth < 3 and hasattr(getattr(v, "__wrapped__", v), "__code__"):
        return ("fn", callable_key(v, depth + 1))
    try:
        hash(v)
    except TypeError:
        return ("id", type(v).__qualname__, id(v))
    if isinstance(v, (int, float, str, bool, bytes, type(None), tuple, frozenset)):
        return ("val", type(v).__qualname__, v)
    return ("obj", type(v).__qualname__, repr(v) if type(v).__repr__ is not object.__repr__ else id(v))


def callable_key(fn, depth: int = 0) -> tuple:
    """(module, qualified name, source hash, closure and default values) of a mod."""
    base = getattr(fn, "__wrapped__", fn)
    try:
        src = inspect.getsource(base).encode()
    except (OSError, TypeError):
        code = getattr(base, "__code__", None)
        src = repr((code.co_code, code.co_consts, code.co_names)).encode() if code is not None else repr(id(fn)).encode()
    cells = tuple(_value_key(c.cell_contents, depth) for c in (getattr(base, "__closure__", None) or ()))
    defaults = tuple(_value_key(d, depth) for d in (getattr(base, "__defaults__", None) or ()))
    attrs = (getattr(fn, "__vec_size__", None),)
    return (getattr(base, "__module__", "?"), getattr(base, "__qualname__", "?"),
            hashlib.sha256(src).hexdigest()[:16], cells, defaults, attrs)


def _name(fn) -> str:
    base = getattr(fn, "__wrapped__", fn)
    return f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', repr(fn))}"


@dataclass(frozen=True)
class ModSpec:
    """The mods of a call, as part of a kernel config: equal keys -> one compiled kernel."""

    key: tuple  # (score_mod key, score_mod_bwd key, mask_mod key), None for an absent mod
    aux_sig: tuple  # ((dtype name, rank), ...) of the aux tensors; () when none
    score_vec: int
    score_mod: object = field(default=None, compare=False, repr=False)
    score_mod_bwd: object = field(default=None, compare=False, repr=False)
    mask_mod: object = field(default=None, compare=False, repr=False)
    recipe: object = field(default=None, compare=False, repr=False)  # (factory path, args) for pickling

    @property
    def names(self) -> str:
        return ", ".join(f"{what}={_name(fn)}" for what, fn in (("score_mod", self.score_mod),
                                                               ("score_mod_bwd", self.score_mod_bwd),
                                                               ("mask_mod", self.mask_mod)) if fn is not None)

    @property
    def has_mask_mod(self) -> bool:
        """Whether a mask_mod is among the mods (also for a compile-gate placeholder, by its recipe)."""
        if self.recipe is not None and self.mask_mod is None:
            return self.recipe[0] in _MASK_FACTORIES
        return self.mask_mod is not None

    @property
    def disk_cacheable(self) -> bool:
        """Only mods defined in this package (their source is in the package fingerprint)."""
        pkg = __name__.rsplit(".", 1)[0]
        return all(k is None or k[0].startswith(pkg) for k in self.key)

    def tag(self) -> str:
        """Short stable tag for config names (the library factory's name when there is one)."""
        digest = hashlib.sha256(repr((self.key, self.aux_sig, self.score_vec)).encode()).hexdigest()[:8]
        return f"-{self.recipe[0]}-{digest}" if self.recipe is not None else f"-{digest}"

    def forward_part(self) -> "ModSpec":
        """The spec without score_mod_bwd (the forward kernel's key: a new backward never recompiles it)."""
        if self.score_mod_bwd is None:
            return self
        recipe = None if self.recipe is None else (*self.recipe[:3], False)
        return ModSpec((self.key[0], None, self.key[2]), self.aux_sig, self.score_vec, self.score_mod, None,
                       self.mask_mod, recipe)

    def __reduce__(self):
        if self.recipe is None:
            raise TypeError(f"mods {self.names} cannot be pickled (only library mods built by a recipe can)")
        return (recipe_placeholder, self.recipe)  # resolved at compile time (``resolved``), not at unpickling

    def resolved(self) -> "ModSpec":
        """The spec with its callables: a recipe placeholder is rebuilt from the library (imports CuTe-DSL)."""
        if self.score_mod is not None or self.mask_mod is not None or self.recipe is None:
            return self
        return _from_recipe(*self.recipe)


def _from_recipe(factory: str, args: tuple, aux_sig: tuple, with_bwd: bool):
    """A library ModSpec rebuilt from its recipe (the compile gate's worker processes unpickle configs so):
    ``mods.<factory>(*args)`` returns the dict of mods."""
    lib = importlib.import_module(f"{__name__.rsplit('.', 1)[0]}.kernels.mods")
    fns = dict(getattr(lib, factory)(*args))
    if not with_bwd:
        fns.pop("score_mod_bwd", None)
    spec = make_mod_spec(aux_sig=tuple(aux_sig), **fns)
    return ModSpec(spec.key, spec.aux_sig, spec.score_vec, spec.score_mod, spec.score_mod_bwd, spec.mask_mod,
                   (factory, tuple(args), tuple(aux_sig), with_bwd))


def check_aux_tensors(aux_tensors, device) -> tuple:
    """Aux tensors as a tuple, checked (device, dtype, rank, int32-addressable); ValueError naming the one."""
    if aux_tensors is None:
        return ()
    if isinstance(aux_tensors, torch.Tensor) or not isinstance(aux_tensors, (list, tuple)):
        raise ValueError(f"aux_tensors must be a list or tuple of tensors, got {type(aux_tensors).__name__}")
    if len(aux_tensors) > MAX_AUX_TENSORS:
        raise ValueError(f"aux_tensors: {len(aux_tensors)} tensors > the supported {MAX_AUX_TENSORS}")
    for i, t in enumerate(aux_tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"aux_tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"aux_tensors[{i}] is on {t.device}, q on {device}")
        if t.dtype not in _AUX_DTYPES:
            raise ValueError(f"aux_tensors[{i}] has dtype {t.dtype}; supported: "
                             f"{', '.join(str(d) for d in _AUX_DTYPES)}")
        if t.dim() < 1:
            raise ValueError(f"aux_tensors[{i}] must have rank >= 1 (a 0-d tensor: use shape (1,)), got 0")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"aux_tensors[{i}] must have a contiguous last dim (stride 1), got strides "
                             f"{tuple(t.stride())}; pass .contiguous()")
        if max((s * (n - 1) for s, n in zip(t.stride(), t.shape) if n > 0), default=0) >= 2**31 or t.numel() >= 2**31:
            raise ValueError(f"aux_tensors[{i}] spans >= 2**31 elements (the kernels index aux tensors in int32)")
    return tuple(aux_tensors)


def aux_signature(aux: tuple) -> tuple:
    return tuple((_AUX_DTYPES[t.dtype], t.dim()) for t in aux)


def _check_callable(name: str, fn, nargs: int):
    if fn is None:
        return
    if not callable(fn):
        raise ValueError(f"{name} must be a @cute.jit callable, got {type(fn).__name__}")
    try:
        params = inspect.signature(getattr(fn, "__wrapped__", fn)).parameters
    except (TypeError, ValueError):
        return
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params.values()):
        return
    required = [p for p in positional if p.default is p.empty]
    if len(required) > nargs or len(positional) < nargs:
        raise ValueError(f"{name}={_name(fn)} takes {len(positional)} positional arguments; upstream flash-attn-4's "
                         f"convention passes {nargs}: "
                         + ("(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors)" if nargs == 7 else
                            "(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors)" if nargs == 8 else
                            "(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors)"))


def make_mod_spec(score_mod=None, score_mod_bwd=None, mask_mod=None, aux_sig: tuple = ()) -> ModSpec | None:
    """The ModSpec of these mods, or None when there are none (aux tensors without a mod are refused by
    ``check_mods``)."""
    if score_mod is None and mask_mod is None:
        return None
    _check_callable("score_mod", score_mod, 7)
    _check_callable("score_mod_bwd", score_mod_bwd, 8)
    _check_callable("mask_mod", mask_mod, 6)
    vec = 1
    if score_mod is not None:
        vec = getattr(score_mod, "__vec_size__", 1 if aux_sig else 2)
        if vec not in (1, 2):
            raise ValueError(f"score_mod={_name(score_mod)}: __vec_size__={vec}; SM120 kernels call score mods on 1 "
                             "or 2 keys at a time (a thread holds key pairs of the mma.sync accumulator)")
    mvec = getattr(mask_mod, "__vec_size__", 1) if mask_mod is not None else 1
    if mvec != 1:
        raise ValueError(f"mask_mod={_name(mask_mod)}: __vec_size__={mvec}; SM120 kernels call mask mods on one "
                         "element at a time (1)")
    key = tuple(None if fn is None else callable_key(fn) for fn in (score_mod, score_mod_bwd, mask_mod))
    return ModSpec(key, tuple(aux_sig), vec, score_mod, score_mod_bwd, mask_mod)


def check_mods(*, score_mod, score_mod_bwd, mask_mod, aux_tensors, device, needs_grad: bool):
    """(ModSpec or None, aux tuple) of a call, or ValueError before any launch (softcap with a score_mod is a
    conflict of compat.py, checked before): a score_mod without score_mod_bwd when gradients are needed; score_mod_bwd without score_mod; aux tensors
    without a mod; a mod that is not callable or takes the wrong number of arguments."""
    if score_mod_bwd is not None and score_mod is None:
        raise ValueError("score_mod_bwd was given without score_mod")
    if score_mod is None and mask_mod is None:
        if aux_tensors is not None:
            raise ValueError("aux_tensors were given without score_mod or mask_mod (nothing would read them)")
        return None, ()
    if score_mod is not None and score_mod_bwd is None and needs_grad:
        refuse("score_mod_grad_no_bwd", mod=_name(score_mod))
    aux = check_aux_tensors(aux_tensors, device)
    spec = make_mod_spec(score_mod, score_mod_bwd if needs_grad else None, mask_mod, aux_signature(aux))
    recipes = {getattr(f, "__fa4_recipe__", None) for f in (score_mod, score_mod_bwd, mask_mod) if f is not None}
    if len(recipes) == 1 and None not in recipes:  # library mods of one factory call: picklable by recipe
        factory, args = recipes.pop()
        spec = ModSpec(spec.key, spec.aux_sig, spec.score_vec, spec.score_mod, spec.score_mod_bwd, spec.mask_mod,
                       (factory, args, spec.aux_sig, spec.score_mod_bwd is not None))
    return spec, aux


# the library's mask_mods (a recipe placeholder knows it holds one by its factory's name)
_MASK_FACTORIES = frozenset({"causal", "sliding_window", "document", "prefix_lm"})


def recipe_placeholder(factory: str, args: tuple, aux_sig: tuple, with_bwd: bool) -> ModSpec:
    """A library ModSpec named by its recipe only, built without importing CuTe-DSL: the compile gate's main
    process must not import it before its worker processes fork (each sets its dump options first).  Unpickled
    in a worker, it becomes the real spec (``_from_recipe``)."""
    key = ("recipe", factory, args, with_bwd)
    return ModSpec((key, None, None), tuple(aux_sig), 1, recipe=(factory, tuple(args), tuple(aux_sig), with_bwd))
