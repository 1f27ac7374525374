"""Which pickle globals ckpt accepts, and the one verdict every command gives on the rest.

Fail closed: a global is safe only if it is named here exactly (or among the torch rebuild
functions, storage types and dtypes of :mod:`ckpt_cli.formats.unpickler`, which
``torch.load(weights_only=True)`` accepts too). Every other global, whether the pickle calls it
or only names it, is an error unless the user allows it by name (``--allow-global``, like
torch's ``add_safe_globals``). The dangerous lists below only choose the wording ("would run
commands"): a name missing from them is still refused as unknown.

The data types are the classes the libraries ckpt reads put in their checkpoints (found by
scanning what torch, transformers, accelerate, Lightning, DCP and DeepSpeed write in the test
fixtures), each judged to be built without running code of its own: a dataclass or plain
object rebuilt by ``__new__`` and a dict update, an enum looked up by value, a container.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from ckpt_cli.errors import UsageError
from ckpt_cli.model import Finding

# Modules whose functions run commands, import or compile code, or reach the network.
DANGEROUS_MODULES = frozenset({
    "os", "posix", "nt", "sys", "subprocess", "runpy", "importlib", "shutil", "socket", "pty",
    "code", "codeop", "commands", "webbrowser", "ctypes", "multiprocessing", "pickle", "_pickle",
    "cPickle", "marshal", "types", "asyncio", "http", "urllib", "requests", "bdb", "pdb",
    "timeit", "venv", "pip", "platform", "signal", "tempfile", "glob", "dill", "cloudpickle",
    "joblib", "imp", "zipimport", "pkgutil", "site", "sysconfig", "ensurepip", "telnetlib",
    "ftplib", "smtplib", "profile", "cProfile", "trace", "doctest", "pydoc", "imaplib",
    "_osx_support", "distutils", "uuid", "_posixsubprocess", "builtins", "__builtin__",
    "_functools", "functools", "operator", "_operator", "__builtins__",
})
DANGEROUS_NAMES = frozenset({
    "torch.load", "torch.serialization.load", "numpy.load", "copyreg._reconstructor_ex",
})
# numpy callables that open files by name, wherever numpy exports them.
NUMPY_FILE_LEAVES = frozenset({
    "fromfile", "tofile", "dump", "dumps", "load", "loads", "loadtxt", "genfromtxt", "save",
    "savez", "savez_compressed", "savetxt", "fromregex", "memmap", "open_memmap", "DataSource",
})
# Packages whose functions reach code execution, the network or the file system when called.
DANGEROUS_PREFIXES = (
    "torch.storage._load_from_bytes", "torch.fx.", "torch.utils.cpp_extension.", "torch.hub.",
    "torch.jit.", "torch._C.", "torch.package.", "torch._dynamo.", "torch._inductor.",
    "torch.utils.data.", "torch.multiprocessing.", "torch.distributed.rpc.",
    "numpy.distutils.", "numpy.testing.", "numpy.f2py.", "numpy.lib.", "numpy.ctypeslib.",
    "numpy.core.memmap.", "numpy._core.memmap.",
)

# ckpt's allowlist beyond torch's own: exact names, never prefixes. torch.load(
# weights_only=True) refuses most of them (so they are reported as an info finding).
DATA_TYPES = frozenset({
    # Python: containers and values rebuilt from plain data.
    "builtins.set", "builtins.frozenset", "builtins.complex", "builtins.bytearray",
    "builtins.slice", "builtins.range", "builtins.object", "builtins.int", "builtins.float",
    "builtins.str", "builtins.bytes", "builtins.bool", "builtins.tuple", "builtins.list",
    "builtins.dict", "collections.defaultdict", "collections.deque", "collections.Counter",
    "argparse.Namespace", "decimal.Decimal", "uuid.UUID", "fractions.Fraction",
    "datetime.datetime", "datetime.date", "datetime.time", "datetime.timedelta",
    "datetime.timezone", "pathlib.Path", "pathlib.PosixPath", "pathlib.WindowsPath",
    "pathlib.PurePath", "pathlib.PurePosixPath", "pathlib.PureWindowsPath",
    "copyreg._reconstructor", "_codecs.encode",
    # numpy arrays, scalars and dtypes (HF Trainer's rng_state.pth holds numpy's RNG state).
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar", "numpy.ndarray",
    "numpy.dtype", *(f"numpy.dtypes.{t}DType" for t in (
        "Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64",
        "Float16", "Float32", "Float64", "LongDouble", "Complex64", "Complex128", "Bytes",
        "Str", "Void", "Object", "Long", "ULong", "LongLong", "ULongLong", "Short",
        "UShort", "Byte", "UByte", "Int", "UInt", "Half", "Double", "Single",
        "CLongDouble", "DateTime64", "TimeDelta64")),
    # torch: a random generator's state; DCP's metadata records.
    "torch._C.Generator",
    *(f"torch.distributed.checkpoint.metadata.{n}" for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING")),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    # A DataLoader saved for resumption: data holders and the default collate functions.
    "torch.utils.data.dataloader.DataLoader", "torch.utils.data.dataset.TensorDataset",
    "torch.utils.data.dataset.Subset", "torch.utils.data.dataset.ConcatDataset",
    "torch.utils.data.sampler.RandomSampler", "torch.utils.data.sampler.SequentialSampler",
    "torch.utils.data.sampler.BatchSampler", "torch.utils.data.sampler.SubsetRandomSampler",
    "torch.utils.data.sampler.WeightedRandomSampler",
    "torch.utils.data.distributed.DistributedSampler",
    "torch.utils.data._utils.collate.default_collate",
    "torch.utils.data._utils.collate.default_convert",
    # transformers: Trainer's training_args.bin (the arguments dataclass and its enums).
    "transformers.training_args.TrainingArguments", "transformers.training_args.OptimizerNames",
    "transformers.trainer_pt_utils.AcceleratorConfig", "transformers.debug_utils.DebugOption",
    *(f"transformers.trainer_utils.{n}" for n in (
        "IntervalStrategy", "SaveStrategy", "SchedulerType", "HubStrategy", "FSDPOption")),
    # accelerate: the process state and its enums, held by TrainingArguments.
    "accelerate.state.PartialState", "accelerate.utils.dataclasses.DistributedType",
    # Lightning: hyper-parameters saved as an attribute dict.
    "lightning.fabric.utilities.data.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    # DeepSpeed: loss scaler, ZeRO stage enum, parameter fragment addresses.
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
})


# Allowlisted only as data: a real loader that calls them (REDUCE, INST, OBJ, a
# copyreg._reconstructor base) runs a constructor that opens the files its arguments name
# (TrainingArguments' __post_init__ reads accelerator_config, fsdp_config, deepspeed), joins
# shared process state (PartialState) or sets up workers. Torch and the libraries write them
# as NEWOBJ (``__new__``) and BUILD (a dict update), which is all ckpt allows of them.
DATA_ONLY = frozenset({
    "transformers.training_args.TrainingArguments",
    "transformers.trainer_pt_utils.AcceleratorConfig", "accelerate.state.PartialState",
    "torch.utils.data.dataloader.DataLoader", "torch.utils.data.distributed.DistributedSampler",
})


def is_dangerous(qualname: str, *, dotted: bool = False) -> bool:
    """Whether a global (not on any allowlist) is one known to run code or reach files.

    Args:
        qualname: ``module.name``.
        dotted: Whether the pickle named an attribute path (``GLOBAL 'torch' 'os.system'``):
            then any component through a dangerous module counts, since the real loader
            follows the path to its end.

    Returns:
        True for the known gadgets.
    """
    parts = qualname.split(".")
    top, leaf = parts[0], parts[-1]
    if (qualname in DANGEROUS_NAMES or (top == "numpy" and leaf in NUMPY_FILE_LEAVES)
            or (top == "pathlib" and len(parts) >= 3)):  # Path.write_text, .unlink
        return True
    if top in DANGEROUS_MODULES or qualname.startswith(DANGEROUS_PREFIXES):
        return True
    return dotted and any(p in DANGEROUS_MODULES or p.startswith("__") for p in parts[1:])


ALLOWED_CODES = frozenset({"unsafe-global", "unknown-global"})
"""The finding codes :func:`allow` can turn into an info finding."""


class Seen(Protocol):
    """What a pickle was seen to do (:class:`ckpt_cli.formats.unpickler.PickleResult`)."""

    @property
    def globals(self) -> Mapping[str, str]: ...  # each global named, with its class
    @property
    def calls(self) -> set[str]: ...  # called or instantiated (REDUCE, NEWOBJ, INST, OBJ)
    @property
    def inits(self) -> set[str]: ...  # whose constructor a real loader would run
    @property
    def builds(self) -> set[str]: ...  # that it tries to modify (BUILD onto a global)


def pickle_findings(seen: Seen, *, file: str | None, what: str = "pickle",
                    sources: Mapping[str, str] | None = None) -> list[Finding]:
    """The verdict on a pickle's globals, the same in every command and format.

    Args:
        seen: What the pickle named, called, constructed and tried to modify.
        file: The file the pickle is in, as the index names it.
        what: The pickle, as the message names it (``pickle``, ``pickle of item step``...).
        sources: For globals seen in another pickle of the file, that pickle's name.

    Returns:
        An ``unsafe-global`` error per global the pickle tries to modify, that is dangerous,
        that is called without being allowlisted, or that is allowlisted only as data and
        constructed (:data:`DATA_ONLY`); an ``unknown-global`` error per other global
        outside the allowlist; a ``non-allowlisted-global`` info per ckpt data type torch's
        weights-only loader refuses. Each finding's location is the global's name.
    """
    out = [Finding("error", "unsafe-global",
                   f"{what} modifies the global {qual} (BUILD onto a class or function: a "
                   "real loader would change it for the rest of the process); not executed",
                   file, qual) for qual in sorted(seen.builds)]
    for qual, cls in sorted(seen.globals.items()):
        if qual in seen.builds:
            continue
        where = (sources or {}).get(qual)
        what_ = f"{what} ({where})" if where else what
        hint = f"not on ckpt's allowlist; --allow-global {qual} accepts it if you trust the file"
        if cls == "dangerous" or (cls == "unknown" and qual in seen.calls):
            verb = "would call" if qual in seen.calls or cls == "dangerous" else "references"
            out.append(Finding("error", "unsafe-global",
                               f"{what_} {verb} {qual} if loaded with torch.load("
                               f"weights_only=False); not executed; {hint}", file, qual))
        elif cls == "unknown":
            out.append(Finding("error", "unknown-global",
                               f"{what_} references {qual}; not imported or executed; {hint}",
                               file, qual))
        elif cls == "benign" and qual in DATA_ONLY and qual in seen.inits:
            out.append(Finding("error", "unsafe-global",
                               f"{what_} would call {qual}(...), whose constructor reads files "
                               "or sets up processes under torch.load(weights_only=False) "
                               "(ckpt allows only its data to be restored); not executed",
                               file, qual))
        elif cls == "benign":
            out.append(Finding("info", "non-allowlisted-global",
                               f"{what_} references {qual}; torch.load(weights_only=True) "
                               "refuses it (ckpt reads it as data)", file, qual))
    return out


def parse_names(names: Iterable[str] | None) -> tuple[str, ...]:
    """Check the names given to ``--allow-global``.

    Args:
        names: ``module.name`` strings (``MODULE.NAME`` as pickles spell them).

    Returns:
        The names, deduplicated, in order.

    Raises:
        UsageError: For a name without a module part.
    """
    out: dict[str, None] = {}
    for n in names or ():
        n = n.strip()
        if "." not in n.strip(".") or any(not p for p in n.split(".")):
            raise UsageError(f"allowed global {n!r} is not MODULE.NAME (e.g. "
                             "argparse.Namespace)")
        out[n] = None
    return tuple(out)


def allow(findings: list[Finding], names: Iterable[str]) -> list[Finding]:
    """Apply ``--allow-global``: the findings of globals the user allows become infos.

    Args:
        findings: Findings of any kind.
        names: ``module.name`` of each global the user trusts.

    Returns:
        The findings, those about allowed globals turned into ``allowed-global`` infos.
    """
    allowed = set(names)
    if not allowed:
        return findings
    return [Finding("info", "allowed-global",
                    f"references {f.location}; allowed by --allow-global", f.file, f.location)
            if f.code in ALLOWED_CODES and f.location in allowed else f for f in findings]


def refused_names(classes: Mapping[str, str]) -> list[str]:
    """The globals outside every allowlist (each an error finding), sorted."""
    return sorted(q for q, c in classes.items() if c in ("dangerous", "unknown"))


def refused(seen: Seen) -> str:
    """For the message of a pickle that could not be read to the end: the globals it names
    that are not allowlisted (the real loader may have run them already).

    Args:
        seen: What the pickle named, called and tried to modify.

    Returns:
        ``"; it would call a.b and references c.d"`` or ``""``.
    """
    classes = seen.globals
    bad = refused_names(classes)
    run = [q for q in bad if q in seen.calls or classes[q] == "dangerous"]
    named = [q for q in bad if q not in run]
    changed = sorted(seen.builds)
    parts = ([f"would call {', '.join(run)}"] if run else []) + (
        [f"references {', '.join(named)}"] if named else []) + (
        [f"modifies {', '.join(changed)}"] if changed else [])
    return f"; it {' and '.join(parts)}" if parts else ""
