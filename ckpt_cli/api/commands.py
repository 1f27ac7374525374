"""One function per command: ``ckpt_cli.inspect(path)`` is ``ckpt inspect PATH``.

Keywords are named like the command's options (``--input-format`` -> ``input_format``); sizes
and durations take numbers (bytes, seconds) or the CLI's text (``"5GB"``, ``"10m"``); paths take
``str``, :class:`os.PathLike` or URLs (``s3://bucket/run``). Each function returns the result the
CLI renders; its ``to_dict()`` is the command's ``--json`` document. Errors are
:class:`~ckpt_cli.errors.CkptError` subclasses whose message is the CLI's, naming these keywords
where the CLI names flags. Nothing here prints, prompts or exits, and importing it loads no
torch, typer or rich: each function imports its command's code when called.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ckpt_cli.api import _args
from ckpt_cli.api._args import PathLike as PathLike
from ckpt_cli.api._args import ProgressCallback as ProgressCallback

# The commands whose engines are in trust/, in a module of their own; re-exported here.
from ckpt_cli.api.trust import resume_path as resume_path
from ckpt_cli.api.trust import watch_once as watch_once
from ckpt_cli.choices import (
    CastTarget,
    ConvertTarget,
    DcpLayout,
    Fp8Activations,
    Fp8Layout,
    InputFormat,
    InspectSort,
    ManifestHash,
    MetricMode,
    Optimizer,
    OutputFormat,
    Precision,
    ThinDtype,
)
from ckpt_cli.ops.consolidate import consolidate as _ops_consolidate
from ckpt_cli.ops.convert import convert as _ops_convert
from ckpt_cli.ops.diff import diff as _ops_diff
from ckpt_cli.ops.inspect import inspect as _ops_inspect
from ckpt_cli.ops.options.consolidate import DEFAULT_MAX_SHARD, ConsolidateOptions
from ckpt_cli.ops.options.convert import ConvertOptions
from ckpt_cli.ops.options.diff import DiffOptions
from ckpt_cli.ops.options.inspect import InspectOptions
from ckpt_cli.ops.options.plan import PlanOptions
from ckpt_cli.ops.options.prune import DEFAULT_GRACE, PruneOptions
from ckpt_cli.ops.options.stats import StatsOptions
from ckpt_cli.ops.options.validate import ValidateOptions
from ckpt_cli.ops.plan import plan as _ops_plan
from ckpt_cli.ops.prune import prune as _ops_prune
from ckpt_cli.ops.stats import stats as _ops_stats
from ckpt_cli.ops.validate import validate as _ops_validate
from ckpt_cli.optionspec import documented

if TYPE_CHECKING:
    from ckpt_cli.ops.consolidate import ConsolidateResult
    from ckpt_cli.ops.convert.result import ConvertResult
    from ckpt_cli.ops.diff.result import DiffResult
    from ckpt_cli.ops.inspect import InspectResult
    from ckpt_cli.ops.plan.result import PlanResult
    from ckpt_cli.ops.prune.result import PruneResult
    from ckpt_cli.ops.stats import StatsResult
    from ckpt_cli.ops.validate.result import ValidateResult
    from ckpt_cli.parts import Part


__all__ = ["PathLike", "ProgressCallback", "consolidate", "convert", "diff", "inspect", "plan",
           "prune", "resume_path", "stats", "validate", "watch_once"]


@_args.deprecated_keywords(InspectOptions)
@documented(InspectOptions)
def inspect(path: PathLike, *, tensors: bool = False, name_glob: str | None = None,
            sort: InspectSort = "name", tree: bool = False, depth: int = 3,
            pattern: str | None = None, input_format: InputFormat | None = None,
            allow_global: str | Iterable[str] | None = None,
            storage_options: Mapping[str, Any] | None = None) -> InspectResult:
    """Describe a checkpoint or a run directory, reading metadata only (``ckpt inspect``).

    Args:
        path: A checkpoint file or directory, a run directory, or a URL.
        {options}
        storage_options: fsspec options for URLs (``{"endpoint_url": ...}``).

    Returns:
        The :class:`~ckpt_cli.ops.inspect.InspectResult` (``index``, ``run``, ``tensors``...);
        ``to_dict()`` is ``ckpt inspect --json``'s document.

    Raises:
        CkptError: A missing path, an unknown format, a corrupt checkpoint.
        UsageError: A bad ``sort`` or ``depth``.

    Example:
        >>> r = ckpt_cli.inspect("demo-run/step_000300/checkpoint.pt")
        >>> r.index.num_parameters, r.to_dict()["format"]
    """

    with _args.api_names():
        _args.use_storage(storage_options, None)
        options = InspectOptions(tensors=tensors, name_glob=name_glob, sort=sort, tree=tree,
                                 depth=depth, pattern=pattern, input_format=input_format,
                                 allow_global=_args.names(allow_global))
        return _ops_inspect(_args.located(path), options)


@_args.deprecated_keywords(ValidateOptions)
@documented(ValidateOptions)
def validate(path: PathLike, *, latest: bool = False, values: bool = False,
             require: str | Iterable[str] | None = None, quick: bool = False,
             write_manifest: bool = False, manifest_hash: ManifestHash = "xxh3_128",
             strict: bool = False, jobs: int | None = None, pattern: str | None = None,
             part: Part | str | None = None, finalize: bool = False,
             parts_dir: PathLike | None = None, input_format: InputFormat | None = None,
             allow_global: str | Iterable[str] | None = None,
             max_memory: int | str | None = None, concurrency: int | None = None,
             storage_options: Mapping[str, Any] | None = None,
             on_progress: ProgressCallback | None = None) -> ValidateResult:
    """Check that a checkpoint (or every checkpoint of a run) is complete, consistent and
    uncorrupted (``ckpt validate``).

    Args:
        path: A checkpoint file or directory, a run directory, or a URL.
        {options}
        storage_options: fsspec options for URLs (``{"endpoint_url": ...}``).
        on_progress: Called as ``(phase, bytes_done, bytes_total)``.

    Returns:
        The :class:`~ckpt_cli.ops.validate.result.ValidateResult`: ``valid`` (no error),
        ``ok`` (what exit status 0 means, ``strict`` included), ``findings``,
        ``checkpoints``; ``to_dict()`` is ``ckpt validate --json``'s document.

    Raises:
        CkptError: The path does not exist or cannot be read; its format is unknown.
        UsageError: Contradictory or bad options.

    Example:
        >>> r = ckpt_cli.validate("demo-run")
        >>> r.ok, [f.message for f in r.findings if f.severity == "error"]
    """

    with _args.api_names():
        _args.use_storage(storage_options, concurrency)
        options = ValidateOptions(
            latest=latest, values=values, require=",".join(_args.names(require)) or None,
            quick=quick, write_manifest=write_manifest, manifest_hash=manifest_hash,
            strict=strict, jobs=jobs, pattern=pattern, part=part, finalize=finalize,
            parts_dir=_args.located(parts_dir) if parts_dir is not None else None,
            input_format=input_format, allow_global=_args.names(allow_global),
            max_memory=_args.size(max_memory, "max_memory"), concurrency=concurrency)
        where = _args.located(path)
        _args.local_only(where if write_manifest else None, "write_manifest's checkpoint",
                         "write_manifest")
        _args.local_only(options.parts_dir, "parts_dir", "parts_dir")
        return _ops_validate(where, options, progress=on_progress)


@_args.deprecated_keywords(DiffOptions)
@documented(DiffOptions)
def diff(a: PathLike, b: PathLike, *, structure_only: bool = False, all_tensors: bool = False,
         strip_prefix: str | Iterable[str] | None = None, exact_names: bool = False,
         rtol: float | None = None, atol: float | None = None, name_glob: str | None = None,
         by_module: bool = False, depth: int | None = None, metadata: bool = True,
         input_format_a: InputFormat | None = None, input_format_b: InputFormat | None = None,
         max_memory: int | str | None = None, concurrency: int | None = None,
         storage_options: Mapping[str, Any] | None = None,
         on_progress: ProgressCallback | None = None) -> DiffResult:
    """Compare two checkpoints: tensors, shapes, dtypes, values, metadata (``ckpt diff``).

    Args:
        a: Checkpoint A (file, shard set or directory, any format), or a URL.
        b: Checkpoint B.
        {options}
        storage_options: fsspec options for URLs (``{"endpoint_url": ...}``).
        on_progress: Called as ``("comparing", bytes_done, bytes_total)``.

    Returns:
        The :class:`~ckpt_cli.ops.diff.result.DiffResult`: ``equal``, ``differences()``,
        ``tensors``, ``only_a``/``only_b``; ``to_dict()`` is ``ckpt diff --json``'s document.

    Raises:
        CkptError: Unreadable input (the message starts with ``A:`` or ``B:``).
        UsageError: Contradictory options.

    Example:
        >>> r = ckpt_cli.diff("demo-run/step_000100", "demo-run/step_000200")
        >>> r.equal, r.to_dict()["summary"]["changed"]
    """

    with _args.api_names():
        _args.use_storage(storage_options, concurrency)
        options = DiffOptions(
            structure_only=structure_only, all_tensors=all_tensors,
            strip_prefix=_args.names(strip_prefix), exact_names=exact_names, rtol=rtol,
            atol=atol, name_glob=name_glob, by_module=by_module, depth=depth,
            metadata=metadata, input_format_a=input_format_a, input_format_b=input_format_b,
            max_memory=_args.size(max_memory, "max_memory"), concurrency=concurrency)
        return _ops_diff(_args.located(a), _args.located(b), options, progress=on_progress)


@_args.deprecated_keywords(StatsOptions)
@documented(StatsOptions)
def stats(path: PathLike, *, all_tensors: bool = False, name_glob: str | None = None,
          depth: int | None = None, hist: bool = False, every: int | None = None,
          last: int | None = None, jump: float = 2.0, no_cache: bool = False,
          cache_dir: PathLike | None = None, jobs: int | None = None,
          part: Part | str | None = None, pattern: str | None = None,
          input_format: InputFormat | None = None,
          allow_global: str | Iterable[str] | None = None,
          max_memory: int | str | None = None, concurrency: int | None = None,
          storage_options: Mapping[str, Any] | None = None,
          on_progress: ProgressCallback | None = None) -> StatsResult:
    """Figures of the weights of a checkpoint, or of every checkpoint of a run (``ckpt stats``).

    Args:
        path: A checkpoint (file, directory) or a run directory, or a URL.
        {options}
        storage_options: fsspec options for URLs (``{"endpoint_url": ...}``).
        on_progress: Called as ``("values", bytes_done, bytes_total)``.

    Returns:
        The :class:`~ckpt_cli.ops.stats.StatsResult`: ``checkpoints`` (each with ``tensors``
        and ``modules``), ``anomalies``, ``exit_code``; ``to_dict()`` is ``ckpt stats
        --json``'s document.

    Raises:
        CkptError: Unreadable input.
        UsageError: Contradictory or bad options.

    Example:
        >>> r = ckpt_cli.stats("demo-run")
        >>> [(a.step, a.module, a.kind) for a in r.anomalies]
    """

    with _args.api_names():
        _args.use_storage(storage_options, concurrency)
        where = _args.located(cache_dir) if cache_dir is not None else None
        _args.local_only(where, "cache_dir", "cache_dir")
        options = StatsOptions(
            all_tensors=all_tensors, name_glob=name_glob, depth=depth, hist=hist, every=every,
            last=last, jump=jump, no_cache=no_cache, cache_dir=where, jobs=jobs,
            part=_args.part(part), pattern=pattern, input_format=input_format,
            allow_global=_args.names(allow_global),
            max_memory=_args.size(max_memory, "max_memory"), concurrency=concurrency)
        return _ops_stats(_args.located(path), options, progress=on_progress)


@_args.deprecated_keywords(ConvertOptions)
@documented(ConvertOptions)
def convert(source: PathLike, output: PathLike, *, to: ConvertTarget = "keep",
            fp8_layout: Fp8Layout = "block", fp8_activations: Fp8Activations = "dynamic",
            dequantize: bool = False, dcp_layout: DcpLayout = "torchtitan",
            output_format: OutputFormat | None = None,
            max_shard_size: int | str | None = None, keep_optimizer: bool = False,
            keep_prefix: bool = False, keep_fp32: str | Iterable[str] | None = None,
            clamp: bool = False, container: str | None = None, overwrite: bool = False,
            part: Part | str | None = None, finalize: bool = False,
            input_format: InputFormat | None = None, max_memory: int | str | None = None,
            concurrency: int | None = None, storage_options: Mapping[str, Any] | None = None,
            on_progress: ProgressCallback | None = None) -> ConvertResult:
    """Convert a checkpoint: training -> inference, FP32 -> FP16/BF16/FP8, torch ->
    safetensors (``ckpt convert``).

    ``to="dcp"`` moves the training state into a DCP directory instead (docs/migrate.md).

    Args:
        source: The checkpoint to convert (file or directory), or a URL.
        output: A ``.safetensors``/``.pt``/``.bin`` file, or a directory (a trailing ``/``
            says a directory whatever the name).
        {options}
        storage_options: fsspec options for URLs.
        on_progress: Called as ``("writing", bytes_done, bytes_total)``.

    Returns:
        The :class:`~ckpt_cli.ops.convert.ConvertResult` (``output``, ``write.files``,
        ``casts``, ``dropped``...); ``to_dict()`` is ``ckpt convert --json``'s document.

    Raises:
        DestinationExistsError: ``output`` exists and ``overwrite`` is False.
        CkptError: Bad input, unsupported layouts, values out of FP16 range.
        UsageError: Contradictory options.

    Example:
        >>> r = ckpt_cli.convert("demo-run", "model-bf16/", to="bf16")
        >>> [f["path"] for f in r.to_dict()["files"]]
    """

    with _args.api_names("output_format"):
        _args.use_storage(storage_options, concurrency)
        options = ConvertOptions(
            to=to, fp8_layout=fp8_layout, fp8_activations=fp8_activations,
            dequantize=dequantize, dcp_layout=dcp_layout, output_format=output_format,
            max_shard_size=_args.size(max_shard_size, "max_shard_size"),
            keep_optimizer=keep_optimizer, keep_prefix=keep_prefix,
            keep_fp32=_args.names(keep_fp32), clamp=clamp, container=container,
            overwrite=overwrite, part=_args.part(part), finalize=finalize,
            input_format=input_format, max_memory=_args.size(max_memory, "max_memory"),
            concurrency=concurrency)
        return _ops_convert(_args.located(source), _args.output(output), options,
                   progress=on_progress)


@_args.deprecated_keywords(ConsolidateOptions)
@documented(ConsolidateOptions)
def consolidate(source: PathLike, output: PathLike, *,
                output_format: OutputFormat | None = None,
                max_shard_size: int | str | None = DEFAULT_MAX_SHARD,
                with_optimizer: bool = False, to: CastTarget = "keep", clamp: bool = False,
                verify: bool = False, manifest: bool = True, overwrite: bool = False,
                part: Part | str | None = None, finalize: bool = False,
                max_memory: int | str | None = None, concurrency: int | None = None,
                storage_options: Mapping[str, Any] | None = None,
                on_progress: ProgressCallback | None = None) -> ConsolidateResult:
    """Merge a rank-sharded checkpoint (DCP, DeepSpeed ZeRO, per-rank files) into few files
    (``ckpt consolidate``).

    Args:
        source: A DCP directory, a DeepSpeed checkpoint (``global_stepN/`` or its save
            directory), HF-style shards, or a directory of per-rank files; or a URL.
        output: The output directory (or a single ``.safetensors``/``.pt`` file).
        {options}
        storage_options: fsspec options for URLs.
        on_progress: Called as ``("writing", bytes_done, bytes_total)``.

    Returns:
        The :class:`~ckpt_cli.ops.consolidate.ConsolidateResult`; ``to_dict()`` is
        ``ckpt consolidate --json``'s document.

    Raises:
        DestinationExistsError: ``output`` exists and ``overwrite`` is False.
        CkptError: Bad or incomplete input (missing rank files, truncated chunks...).

    Example:
        >>> r = ckpt_cli.consolidate("demo-run/step_000400", "step400-full/")
        >>> r.tensors, r.lost_elements
    """

    with _args.api_names("output_format"):
        _args.use_storage(storage_options, concurrency)
        options = ConsolidateOptions(
            output_format=output_format,
            max_shard_size=_args.size(max_shard_size, "max_shard_size", allow_zero=True),
            with_optimizer=with_optimizer, to=to, clamp=clamp, verify=verify,
            manifest=manifest, overwrite=overwrite, part=_args.part(part), finalize=finalize,
            max_memory=_args.size(max_memory, "max_memory"), concurrency=concurrency)
        return _ops_consolidate(_args.located(source), _args.output(output), options,
                   progress=on_progress)


@_args.deprecated_keywords(PruneOptions)
@documented(PruneOptions)
def prune(run_dir: PathLike, *, keep: int | None = None, keep_every: int | str | None = None,
          keep_best: int | None = None, metric: str | None = None, mode: MetricMode = "min",
          older_than: float | str | None = None, max_total_size: int | str | None = None,
          grace: float | str = DEFAULT_GRACE, thin_after: int | None = None,
          thin_to: ThinDtype | None = None, keep_full_every: int | str | None = None,
          keep_abandoned: bool = False, metrics_file: PathLike | None = None,
          pattern: str | None = None, any_dir: bool = False, dry_run: bool = True,
          storage_options: Mapping[str, Any] | None = None,
          on_progress: ProgressCallback | None = None) -> PruneResult:
    """Delete old checkpoints of a run directory by retention rules (``ckpt prune --yes``).

    A checkpoint is kept if any rule keeps it. Never deleted: what a resume pointer names,
    anything that may still be being written, and the newest valid checkpoint. Nothing is
    deleted unless ``dry_run=False``; no question is asked. Counts, sizes and ages take
    numbers (steps, bytes, seconds) or text (``"10K"``, ``"2TB"``, ``"7d"``).

    Args:
        run_dir: The run directory (or an object-store prefix).
        {options}
        dry_run: Only plan (the default); False deletes.
        storage_options: fsspec options for URLs.
        on_progress: Called as ``("deleting", checkpoints_done, checkpoints_to_delete)``.

    Returns:
        The :class:`~ckpt_cli.ops.prune.result.PruneResult`: ``deleted``, ``ok``,
        ``plan.decisions``; ``to_dict()`` is ``ckpt prune --json``'s document.

    Raises:
        UsageError: A policy that cannot be meant, a root refused without ``any_dir``.
        CkptError: The directory is missing or unreadable, or another prune holds the lock.

    Example:
        >>> r = ckpt_cli.prune("demo-run", keep=2)  # a dry run
        >>> [c["name"] for c in r.to_dict()["checkpoints"] if c["action"] == "delete"]
    """

    with _args.api_names():
        _args.use_storage(storage_options, None)
        metrics = _args.located(metrics_file) if metrics_file is not None else None
        options = PruneOptions(
            keep=keep, keep_every=_args.count(keep_every, "keep_every"), keep_best=keep_best,
            metric=metric, mode=mode, older_than=_args.duration(older_than, "older_than"),
            max_total_size=_args.size(max_total_size, "max_total_size"),
            grace=_args.duration(grace, "grace", allow_zero=True) or 0.0,
            thin_after=thin_after, thin_to=thin_to,
            keep_full_every=_args.count(keep_full_every, "keep_full_every"),
            keep_abandoned=keep_abandoned, metrics_file=metrics, pattern=pattern,
            any_dir=any_dir)
        options.check()
        _args.local_only(metrics, "metrics_file", "metrics_file")
        return _ops_prune(_args.located(run_dir), options, pattern=pattern, metrics_file=metrics,
                   dry_run=dry_run, any_dir=any_dir, progress=on_progress)


@_args.deprecated_keywords(PlanOptions)
@documented(PlanOptions)
def plan(*, params: int | str | None = None, precision: Precision | None = None,
         optimizer: Optimizer | None = None, from_path: PathLike | None = None,
         input_format: InputFormat | None = None, bandwidth: float | str | None = None,
         measure_dir: PathLike | None = None, measure_size: int | str | None = None,
         measure_streams: int | None = None, mtbf: float | str | None = None,
         gpus: int | None = None, gpu_mtbf: float | str | None = None,
         ranks: int | None = None, keep: int | None = None, thin_after: int | None = None,
         thin_to: ThinDtype | None = None, async_save: bool = False,
         snapshot_bandwidth: float | str | None = None, interval: float | str | None = None,
         restart: float | str | None = None,
         on_progress: ProgressCallback | None = None) -> PlanResult:
    """Plan checkpointing: checkpoint size, write time, optimal interval, storage and files
    (``ckpt plan``).

    Args:
        {options}
        on_progress: Called as ``("measuring", bytes_written, bytes_total)``.

    Returns:
        The :class:`~ckpt_cli.ops.plan.result.PlanResult` (``young``, ``daly``,
        ``overhead_at()``...); ``to_dict()`` is ``ckpt plan --json``'s document.

    Raises:
        UsageError: Missing or contradictory inputs.
        CkptError: An unreadable ``from_path``.

    Example:
        >>> r = ckpt_cli.plan(params="7B", bandwidth="2GB/s", mtbf="12h")
        >>> r.daly.seconds if r.daly else None
    """

    with _args.api_names():
        _args.local_only(_args.located(measure_dir) if measure_dir is not None else None,
                         "measure_dir", "measure_dir")
        options = PlanOptions(
            params=_args.count(params, "params"), precision=precision, optimizer=optimizer,
            from_path=_args.located(from_path) if from_path is not None else None,
            input_format=input_format, bandwidth=_args.rate(bandwidth, "bandwidth"),
            measure_dir=_args.located(measure_dir) if measure_dir is not None else None,
            measure_size=_args.size(measure_size, "measure_size"),
            measure_streams=_args.count(measure_streams, "measure_streams"),
            mtbf=_args.duration(mtbf, "mtbf"), gpus=_args.count(gpus, "gpus"),
            gpu_mtbf=_args.duration(gpu_mtbf, "gpu_mtbf"), ranks=_args.count(ranks, "ranks"),
            keep=_args.count(keep, "keep"), async_save=async_save,
            thin_after=_args.count(thin_after, "thin_after"), thin_to=thin_to,
            snapshot_bandwidth=_args.rate(snapshot_bandwidth, "snapshot_bandwidth"),
            interval=_args.duration(interval, "interval"),
            restart=_args.duration(restart, "restart", allow_zero=True))
        return _ops_plan(options, progress=on_progress)
