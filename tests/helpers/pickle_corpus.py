"""A regression corpus of hostile pickles for ckpt's scanner (issue 23).

Every case is a file that runs a payload when loaded by the real loader (``pickle.load`` or
``torch.load(weights_only=False)``) and that ckpt must refuse, naming the global(s) it would
call. The payloads are harmless by construction: the only effect is creating a marker file
(``MARKER_<case>``) in the current directory, either by Python code ``open(<marker>, 'w')``
handed to an exec-like sink or by the shell command ``touch <marker>`` handed to a command
sink. Nothing else is ever run.

Standard library only (no torch: torch zip files are written with :mod:`zipfile`, or byte by
byte where the case is a zip that :mod:`zipfile` cannot write; the assembler and the zip
writers are :mod:`tests.helpers.pickle_asm`), and deterministic: the pickles
are assembled opcode by opcode and every zip date is fixed, so two builds give the same bytes.

Run ``python -m tests.helpers.pickle_corpus OUTDIR`` to write the corpus and list it; import
:func:`build` to get the :class:`Case` records.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.pickle_asm import (
    BUILD,
    EMPTY_DICT,
    EMPTY_LIST,
    EMPTY_TUPLE,
    MARK,
    MEMOIZE,
    NONE,
    OBJ,
    POP,
    REDUCE,
    SETITEM,
    TRUE,
    TUPLE,
    _records,
    bad_crc,
    bare,
    by,
    call,
    code,
    dct,
    get,
    glob,
    i,
    legacy_tar,
    lst,
    proto,
    put,
    s,
    s0,
    sglob,
    shell,
    state_dict,
    torch_zip,
    tup,
    two_central_directories,
)

PICKLE = "pickle"  # loaded with pickle.load(open(path, 'rb'))
TORCH = "torch"  # loaded with torch.load(path, weights_only=False)


@dataclass(frozen=True)
class Case:
    """One corpus file.

    Attributes:
        name: identifier (also the stem of the file and of the marker).
        path: the file written.
        technique: what the case does, in a sentence.
        source: where the technique comes from (issue 23 item, URL or advisory ID).
        expect: substrings ckpt's refusal must contain (the globals it would call).
        loader: ``pickle`` or ``torch``: how the real loader reads the file.
        marker: file the payload creates in the current directory when it runs.
        needs: dotted names (a module, then attributes) the payload's sink needs; where one
            does not resolve here (see :func:`resolves`) the execution check is skipped, but
            ckpt must still refuse the file.
        works_if: a Python expression, true where the installed library still has the gadget
            the technique relies on (empty: always); false skips the execution check.
    """

    name: str
    path: Path
    technique: str
    source: str
    expect: tuple[str, ...]
    loader: str
    marker: str
    needs: tuple[str, ...] = ()
    works_if: str = ""


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names something here: the longest importable module prefix, then
    attributes. Imports modules (run it where importing the sink's module is acceptable)."""
    import importlib

    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


# --- the cases -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Spec:
    name: str
    technique: str
    source: str
    expect: tuple[str, ...]
    loader: str
    ext: str
    make: Callable[[str], bytes]  # marker -> file bytes
    needs: tuple[str, ...] = ()
    works_if: str = ""


ISSUE = "issue 23 item 1"
PICKLESCAN_SCANNER = ("https://github.com/mmaitre314/picklescan/blob/main/src/picklescan/"
                      "scanner.py (_unsafe_globals)")


def _zip(payload: Callable[[str], bytes], protocol: int = 2) -> Callable[[str], bytes]:
    """A torch zip whose data.pkl is a state dict carrying ``payload(marker)``."""
    return lambda m: torch_zip(_records(state_dict(payload(m), protocol)))


def _pkl(payload: Callable[[str], bytes], protocol: int = 2) -> Callable[[str], bytes]:
    """A plain pickle file whose value is ``payload(marker)``."""
    return lambda m: bare(payload(m), protocol)


def _colliding(evil_name: str, m: str) -> list[tuple[str, bytes]]:
    # The hostile record first, the benign data.pkl after data/0: with this order torch 2.13's
    # reader (a binary search over names sorted without case) lands on the hostile one.
    rest = _records(b"")[1:]
    hostile = (evil_name, state_dict(call(glob("os", "system"), s(shell(m)))))
    return [hostile, *rest[:4], ("archive/data.pkl", state_dict(EMPTY_DICT)), *rest[4:]]


def _runsource(m: str) -> bytes:
    # trace.Trace(0, 0).run(code): Trace.run is reached as a dotted name (protocol 4).
    return call(sglob("trace", "Trace.run"), call(glob("trace", "Trace"), i(0), i(0)),
                s(code(m)))


def _planted(m: str) -> bytes:
    # BUILD onto the module collections.abc plants an attribute that does not exist at rest,
    # then a global naming it is called.
    return (sglob("collections", "abc") + EMPTY_DICT + s("Sized2")
            + glob("profile", "run") + SETITEM + BUILD + POP
            + call(sglob("collections.abc", "Sized2"), s(code(m))))


def _numpy_builtins_get(m: str) -> bytes:
    # numpy.core.numeric.__builtins__ is the builtins dict; .get('exec') returns exec.
    getter = sglob("numpy.core.numeric", "__builtins__.get")
    return call(call(getter, s("exec")), s(code(m)))


def _numpy_size_build(m: str) -> bytes:
    # modelscan #330: BUILD sets numpy.size.shape = numpy.__builtins__ (a dict), so
    # numpy.size(numpy.size, 'eval') returns numpy.size.shape['eval'] == eval.
    return (sglob("numpy", "size") + MEMOIZE + POP
            + get(0) + tup(EMPTY_DICT, dct(shape=sglob("numpy", "__builtins__"))) + BUILD + POP
            + call(call(get(0), get(0), s("eval")), s(code(m))))


def _numpy_prod_memo(m: str) -> bytes:
    # modelscan #85: BUILD stores the strings "os" and "system" as attributes of numpy.prod,
    # dotted GLOBALs fetch them back, and STACK_GLOBAL puts them together.
    return (glob("numpy", "prod") + tup(NONE, dct(a=s("os"))) + BUILD
            + tup(NONE, dct(b=s("system"))) + BUILD + POP
            + glob("numpy", "prod.a") + glob("numpy", "prod.b") + b"\x93"
            + tup(s(shell(m))) + REDUCE)


def _memo_confusion(m: str) -> bytes:
    # picklescan #14 / #22: BINPUT and MEMOIZE mixed so that a scanner that numbers the memo
    # by MEMOIZE alone resolves STACK_GLOBAL to torch._utils._rebuild_tensor_v2.
    return (s("os") + put(0) + POP + s("system") + put(1) + POP
            + s("torch._utils") + MEMOIZE + POP + s("_rebuild_tensor_v2") + MEMOIZE + POP
            + get(0) + get(1) + b"\x93" + tup(s(shell(m))) + REDUCE)


def _inner_system(m: str) -> bytes:
    return bare(call(glob("posix", "system"), s(shell(m))))


def _subinterpreter(m: str) -> bytes:
    # fickling GHSA-6ggj-6f2q-f7mx names _interpreters (3.13); 3.11/3.12 have the same
    # functions in _xxsubinterpreters. create() gives an id, run_string runs source in it.
    return call(glob("_xxsubinterpreters", "run_string"),
                call(glob("_xxsubinterpreters", "create")), s(code(m)))


SPECS: tuple[_Spec, ...] = (
    # --- issue 23 item 1: callables outside the allowlist that only warned ---------------
    _Spec("profile_run", "profile.run(code) execs its statement", ISSUE, ("profile.run",),
          TORCH, ".pt", _zip(lambda m: call(glob("profile", "run"), s(code(m))))),
    _Spec("cprofile_run", "cProfile.run(code) execs its statement", ISSUE, ("cProfile.run",),
          TORCH, ".pt", _zip(lambda m: call(glob("cProfile", "run"), s(code(m))))),
    _Spec("cprofile_runctx", "cProfile.runctx(code, {}, {}) execs its statement", ISSUE,
          ("cProfile.runctx",), TORCH, ".pt",
          _zip(lambda m: call(glob("cProfile", "runctx"), s(code(m)), EMPTY_DICT,
                              EMPTY_DICT))),
    _Spec("trace_run", "trace.Trace(0, 0) then Trace.run(code) (a dotted protocol-4 name)",
          ISSUE, ("trace.Trace",), TORCH, ".pt", _zip(_runsource, 4)),
    _Spec("trace_runctx", "trace.Trace.runctx(Trace(0, 0), code, {}, {})", ISSUE,
          ("trace.Trace",), TORCH, ".pt",
          _zip(lambda m: call(sglob("trace", "Trace.runctx"),
                              call(glob("trace", "Trace"), i(0), i(0)), s(code(m)),
                              EMPTY_DICT, EMPTY_DICT), 4)),
    _Spec("doctest_debug_script", "doctest.debug_script(code, True) execs its source",
          ISSUE, ("doctest.debug_script",), TORCH, ".pt",
          _zip(lambda m: call(glob("doctest", "debug_script"), s(code(m)), TRUE))),
    _Spec("doctest_run_docstring_examples",
          "doctest.run_docstring_examples('>>> code', {}) runs the example", ISSUE,
          ("doctest.run_docstring_examples",), TORCH, ".pt",
          _zip(lambda m: call(glob("doctest", "run_docstring_examples"),
                              s(">>> " + code(m) + "\n"), EMPTY_DICT))),
    _Spec("uuid_get_command_stdout", "uuid._get_command_stdout('touch', marker) runs it",
          ISSUE + "; CVE-2026-56315", ("uuid._get_command_stdout",), TORCH, ".pt",
          _zip(lambda m: call(glob("uuid", "_get_command_stdout"), s("touch"), s(m)))),
    _Spec("pydoc_pipepager", "pydoc.pipepager(text, cmd) runs cmd through the shell", ISSUE,
          ("pydoc.pipepager",), TORCH, ".pt",
          _zip(lambda m: call(glob("pydoc", "pipepager"), s(""), s(shell(m))))),
    _Spec("imaplib_imap4_stream", "imaplib.IMAP4_stream(cmd) runs cmd through the shell",
          ISSUE + "; CVE-2026-56315", ("imaplib.IMAP4_stream",), TORCH, ".pt",
          _zip(lambda m: call(glob("imaplib", "IMAP4_stream"), s(shell(m))))),
    _Spec("osx_support_read_output", "_osx_support._read_output(cmd) runs os.system(cmd)",
          ISSUE + "; CVE-2026-56315", ("_osx_support._read_output",), TORCH, ".pt",
          _zip(lambda m: call(glob("_osx_support", "_read_output"), s(shell(m)))),
          needs=("_osx_support._read_output",)),
    _Spec("distutils_spawn", "distutils.spawn.spawn(['touch', marker])", ISSUE,
          ("distutils.spawn",), TORCH, ".pt",
          _zip(lambda m: call(glob("distutils.spawn", "spawn"), lst(s("touch"), s(m)))),
          needs=("distutils.spawn.spawn",)),
    _Spec("functools_c_reduce",
          "_functools.reduce(pydoc.pipepager, [cmd], text): the C module's name for reduce",
          ISSUE, ("_functools.reduce",), TORCH, ".pt",
          _zip(lambda m: call(glob("_functools", "reduce"), glob("pydoc", "pipepager"),
                              lst(s(shell(m))), s("")))),
    _Spec("cpickle_loads", "protocol 2 cPickle.loads (mapped to pickle.loads) of a nested "
          "pickle", ISSUE, ("pickle.loads",), TORCH, ".pt",
          _zip(lambda m: call(glob("cPickle", "loads"), by(_inner_system(m))))),
    _Spec("dotted_torch_os_system", "GLOBAL 'torch' 'os.system' (protocol 4 resolves the "
          "attribute path)", ISSUE, ("os.system",), TORCH, ".pt",
          _zip(lambda m: call(glob("torch", "os.system"), s(shell(m))), 4)),
    _Spec("dotted_torch_serialization_os_system", "GLOBAL 'torch.serialization' 'os.system'",
          ISSUE, ("os.system",), TORCH, ".pt",
          _zip(lambda m: call(glob("torch.serialization", "os.system"), s(shell(m))), 4)),
    _Spec("dotted_posixpath_os_system", "GLOBAL 'posixpath' 'os.system'", ISSUE,
          ("os.system",), TORCH, ".pt",
          _zip(lambda m: call(glob("posixpath", "os.system"), s(shell(m))), 4)),
    _Spec("dotted_numpy_builtins", "STACK_GLOBAL 'numpy.core.numeric' '__builtins__.get', "
          "called with 'exec', whose result is called with code", ISSUE,
          ("__builtins__",), TORCH, ".pt", _zip(_numpy_builtins_get, 4),
          needs=("numpy.core.numeric",)),
    # --- issue 23 item 4 -----------------------------------------------------------------
    _Spec("chain_unknown_only", "pydoc.locate('os.system') returns a callable that the "
          "pickle then calls: a chain of unknown globals only", "issue 23 item 4",
          ("pydoc.locate",), TORCH, ".pt",
          _zip(lambda m: call(call(glob("pydoc", "locate"), s("os.system")), s(shell(m))))),
    _Spec("global_attribute_absent", "BUILD plants collections.abc.Sized2 (absent at rest) "
          "= profile.run, then calls it", "issue 23 item 4 (and item 3: BUILD onto a global)",
          ("collections.abc.Sized2",), TORCH, ".pt", _zip(_planted, 4)),
    # --- issue 23 item 2: containers torch reads differently ------------------------------
    _Spec("zip_two_central_directories", "two central directories: zipfile reads a benign "
          "data.pkl, torch's reader the one calling os.system", "issue 23 item 2a",
          ("os.system",), TORCH, ".pt",
          lambda m: two_central_directories(
              state_dict(EMPTY_DICT),
              state_dict(call(glob("os", "system"), s(shell(m)))))),
    _Spec("zip_data_pkl_upper_case", "the pickle record is archive/Data.PKL: torch's lookup "
          "ignores case", "issue 23 item 2b", ("os.system",), TORCH, ".pt",
          lambda m: torch_zip(_records(state_dict(call(glob("os", "system"), s(shell(m)))),
                                       "Data.PKL"))),
    _Spec("zip_case_colliding_records", "archive/DATA.PKL (calls os.system) first, "
          "archive/data.pkl (benign) later: zipfile reads data.pkl, torch's case-blind lookup "
          "DATA.PKL", "issue 23 item 2b / What: case-colliding names", ("os.system",), TORCH,
          ".pt", lambda m: torch_zip(_colliding("archive/DATA.PKL", m))),
    _Spec("zip_duplicate_records", "archive/data.pkl twice: zipfile's name lookup keeps the "
          "last (benign), torch's the first (calls os.system)",
          "issue 23 What: duplicate record names", ("os.system",), TORCH, ".pt",
          lambda m: torch_zip(_colliding("archive/data.pkl", m))),
    _Spec("zip_bad_crc", "data.pkl's CRC-32 is wrong: zipfile refuses to read the record, "
          "torch's reader does not check it", "CVE-2025-10156 (JFrog, picklescan); "
          "https://github.com/protectai/modelscan/issues/263", ("os.system",), TORCH, ".pt",
          lambda m: bad_crc(state_dict(call(glob("os", "system"), s(shell(m)))))),
    _Spec("protocol0_whole_file", "a protocol-0 (text) pickle as a whole .pt file",
          "issue 23 item 2c", ("os.system",), TORCH, ".pt",
          _pkl(lambda m: glob("os", "system") + MARK + s0(shell(m)) + TUPLE + REDUCE, 0)),
    _Spec("protocol1_whole_file", "a protocol-1 pickle (binary opcodes, no PROTO) as a "
          "whole .pt file", "issue 23 item 2c", ("profile.run",), TORCH, ".pt",
          _pkl(lambda m: glob("profile", "run") + MARK + s(code(m)) + TUPLE + REDUCE, 1)),
    _Spec("legacy_tar_pickle_member", "torch's legacy tar format whose 'pickle' member calls "
          "os.system", "issue 23 item 2c", ("os.system",), TORCH, ".tar",
          lambda m: legacy_tar(bare(call(glob("os", "system"), s(shell(m)))))),
    # --- published picklescan / modelscan / fickling bypasses -----------------------------
    _Spec("pkgutil_resolve_name", "pkgutil.resolve_name('os:system') returns os.system, "
          "then called", "GHSA-vvpj-8cmc-gx39 (picklescan)", ("pkgutil.resolve_name",),
          PICKLE, ".pkl", _pkl(lambda m: call(call(glob("pkgutil", "resolve_name"),
                                                   s("os:system")), s(shell(m))))),
    _Spec("importlib_import_module_chain", "importlib.import_module('os') then "
          "builtins.getattr(module, 'system')", "https://github.com/protectai/modelscan/"
          "issues/331; https://github.com/mmaitre314/picklescan/pull/74",
          ("importlib.import_module",), PICKLE, ".pkl",
          _pkl(lambda m: call(call(glob("builtins", "getattr"),
                                   call(glob("importlib", "import_module"), s("os")),
                                   s("system")), s(shell(m))), 4)),
    _Spec("operator_c_methodcaller", "_operator.methodcaller('system', cmd) applied to "
          "posixpath.os (no 'os' global)", "GHSA-m273-6v24-x4m4, GHSA-955r-x9j8-7rhh "
          "(picklescan)", ("_operator.methodcaller",), PICKLE, ".pkl",
          _pkl(lambda m: call(call(glob("_operator", "methodcaller"), s("system"),
                                   s(shell(m))), sglob("posixpath", "os")), 4)),
    _Spec("operator_c_attrgetter", "_operator.attrgetter('system')(posixpath.os)(cmd)",
          "GHSA-m273-6v24-x4m4, GHSA-955r-x9j8-7rhh (picklescan)",
          ("_operator.attrgetter",), PICKLE, ".pkl",
          _pkl(lambda m: call(call(call(glob("_operator", "attrgetter"), s("system")),
                                   sglob("posixpath", "os")), s(shell(m))), 4)),
    _Spec("logging_filehandler", "logging.FileHandler(marker) creates the file",
          "CVE-2026-56304 (picklescan)", ("logging.FileHandler",), TORCH, ".pt",
          _zip(lambda m: call(glob("logging", "FileHandler"), s(m)))),
    _Spec("filehandler_reduce_build", "a REDUCE followed by a BUILD (fickling dropped the "
          "call from its analysis)", "GHSA-mhc9-48gj-9gp3 (fickling)",
          ("logging.FileHandler",), PICKLE, ".pkl",
          _pkl(lambda m: call(glob("logging", "FileHandler"), s(m)) + EMPTY_DICT + BUILD)),
    _Spec("mailcap_findmatch", "mailcap.findmatch runs an entry's 'test' command",
          "https://github.com/mmaitre314/picklescan/pull/69; "
          "https://github.com/protectai/modelscan/pull/346", ("mailcap.findmatch",), TORCH,
          ".pt", _zip(lambda m: call(
              glob("mailcap", "findmatch"),
              dct(**{"text/plain": lst(dct(view=s("true %s"), test=s(shell(m))))}),
              s("text/plain"))), needs=("mailcap.findmatch",)),
    _Spec("aix_support_read_cmd_output", "_aix_support._read_cmd_output(cmd) runs "
          "os.system(cmd)", "CVE-2026-56315 (picklescan)", ("_aix_support._read_cmd_output",),
          TORCH, ".pt",
          _zip(lambda m: call(glob("_aix_support", "_read_cmd_output"), s(shell(m)))),
          needs=("_aix_support._read_cmd_output",)),
    _Spec("pyrepl_pager_pipe_pager", "_pyrepl.pager.pipe_pager(text, cmd) runs cmd "
          "(Python 3.13+)", "CVE-2026-56315 (picklescan)", ("_pyrepl.pager",), TORCH, ".pt",
          _zip(lambda m: call(glob("_pyrepl.pager", "pipe_pager"), s(""), s(shell(m)))),
          needs=("_pyrepl.pager.pipe_pager",)),
    _Spec("torch_collect_env_run", "torch.utils.collect_env.run(cmd) runs it through the "
          "shell", "https://github.com/protectai/modelscan/issues/338",
          ("torch.utils.collect_env.run",), TORCH, ".pt",
          _zip(lambda m: call(glob("torch.utils.collect_env", "run"), s(shell(m))))),
    _Spec("torch_jit_exec_wrapper", "torch.jit.unsupported_tensor_ops.execWrapper(code, {}, "
          "{}) execs", PICKLESCAN_SCANNER, ("execWrapper",), TORCH, ".pt",
          _zip(lambda m: call(glob("torch.jit.unsupported_tensor_ops", "execWrapper"),
                              s(code(m)), EMPTY_DICT, EMPTY_DICT))),
    _Spec("torch_bottleneck_run_cprofile", "torch.utils.bottleneck.__main__.run_cprofile("
          "code, {}) execs", PICKLESCAN_SCANNER, ("run_cprofile",), TORCH, ".pt",
          _zip(lambda m: call(glob("torch.utils.bottleneck.__main__", "run_cprofile"),
                              s(code(m)), EMPTY_DICT)),
          needs=("torch.utils.bottleneck.__main__.run_cprofile",)),
    _Spec("multiprocessing_spawnv_passfds", "multiprocessing.util.spawnv_passfds runs a "
          "program", "https://github.com/protectai/modelscan/issues/338",
          ("spawnv_passfds",), PICKLE, ".pkl",
          _pkl(lambda m: call(glob("multiprocessing.util", "spawnv_passfds"), by(b"/bin/sh"),
                              lst(s("/bin/sh"), s("-c"), s(shell(m))), EMPTY_TUPLE))),
    _Spec("code_interactive_interpreter", "code.InteractiveInterpreter().runsource(code)",
          PICKLESCAN_SCANNER, ("code.InteractiveInterpreter",), PICKLE, ".pkl",
          _pkl(lambda m: call(sglob("code", "InteractiveInterpreter.runsource"),
                              call(glob("code", "InteractiveInterpreter")), s(code(m))), 4)),
    _Spec("timeit_setup", "timeit.timeit('pass', setup) runs setup once",
          PICKLESCAN_SCANNER, ("timeit.timeit",), PICKLE, ".pkl",
          _pkl(lambda m: call(glob("timeit", "timeit"), s("pass"), s(code(m)),
                              glob("time", "perf_counter"), i(1)))),
    _Spec("runpy_run_code", "runpy._run_code(code, {})", PICKLESCAN_SCANNER,
          ("runpy._run_code",), PICKLE, ".pkl",
          _pkl(lambda m: call(glob("runpy", "_run_code"), s(code(m)), EMPTY_DICT))),
    _Spec("bdb_run", "bdb.Bdb().run(code)", "https://github.com/mmaitre314/picklescan/pull/29",
          ("bdb.Bdb",), PICKLE, ".pkl",
          _pkl(lambda m: call(sglob("bdb", "Bdb.run"), call(glob("bdb", "Bdb")),
                              s(code(m))), 4)),
    _Spec("pty_spawn_obj", "OBJ opcode calling pty.spawn(['sh', '-c', cmd])",
          "https://github.com/trailofbits/fickling/pull/108", ("pty.spawn",), PICKLE, ".pkl",
          _pkl(lambda m: MARK + glob("pty", "spawn")
               + lst(s("/bin/sh"), s("-c"), s(shell(m))) + OBJ)),
    _Spec("inst_os_system", "INST opcode (protocol 0) calling os.system",
          "https://github.com/trailofbits/fickling/pull/108 (INST/OBJ call forms)",
          ("os.system",), PICKLE, ".pkl",
          _pkl(lambda m: MARK + s0(shell(m)) + b"ios\nsystem\n", 0)),
    _Spec("numpy_testing_runstring", "numpy.testing._private.utils.runstring(code, {})",
          PICKLESCAN_SCANNER, ("runstring",), PICKLE, ".pkl",
          _pkl(lambda m: call(glob("numpy.testing._private.utils", "runstring"), s(code(m)),
                              EMPTY_DICT)), needs=("numpy.testing._private.utils.runstring",)),
    _Spec("numpy_size_build_builtins", "BUILD sets numpy.size.shape to numpy.__builtins__; "
          "numpy.size(numpy.size, 'eval') returns eval",
          "https://github.com/protectai/modelscan/issues/330", ("numpy.size",), PICKLE,
          ".pkl", _pkl(_numpy_size_build, 4), needs=("numpy.size",),
          works_if=("'a.shape[axis]' in __import__('inspect').getsource("
                    "__import__('numpy').size)")),
    _Spec("numpy_prod_build_memo", "BUILD stores 'os'/'system' on numpy.prod, dotted GLOBALs "
          "read them back into STACK_GLOBAL", "https://github.com/protectai/modelscan/"
          # ckpt stops following the data flow at the BUILD onto numpy.prod (refused, named):
          # the planted strings never reach STACK_GLOBAL, so os.system is not named.
          "issues/85", ("numpy.prod",), PICKLE, ".pkl", _pkl(_numpy_prod_memo, 5),
          needs=("numpy.prod",)),
    _Spec("memo_confusion", "BINPUT and MEMOIZE mixed so a memo-by-MEMOIZE scanner sees "
          "torch._utils._rebuild_tensor_v2", "https://github.com/mmaitre314/picklescan/"
          "issues/14; https://github.com/mmaitre314/picklescan/issues/22", ("os.system",),
          PICKLE, ".pkl", _pkl(_memo_confusion, 4)),
    _Spec("nested_pickle_loads", "_pickle.loads of a nested pickle calling posix.system",
          "GHSA-84r2-jw7c-4r5q (picklescan); https://github.com/protectai/modelscan/"
          "issues/267", ("pickle.loads",), PICKLE, ".pkl",
          _pkl(lambda m: call(glob("_pickle", "loads"), by(_inner_system(m))))),
    _Spec("lib2to3_grammar_loads", "lib2to3.pgen2.grammar.Grammar().loads(nested pickle)",
          "GHSA-r8g5-cgf2-4m4m (picklescan)", ("Grammar.loads",), PICKLE, ".pkl",
          _pkl(lambda m: call(sglob("lib2to3.pgen2.grammar", "Grammar.loads"),
                              call(glob("lib2to3.pgen2.grammar", "Grammar")),
                              by(_inner_system(m))), 4),
          needs=("lib2to3.pgen2.grammar.Grammar.loads",)),
    _Spec("subinterpreter_run_string", "_xxsubinterpreters.run_string(create(), code)",
          "GHSA-6ggj-6f2q-f7mx (fickling)", ("run_string",), PICKLE, ".pkl",
          _pkl(_subinterpreter), needs=("_xxsubinterpreters.run_string",)),
    _Spec("distutils_write_file", "distutils.file_util.write_file(marker, []) writes a file",
          "https://github.com/trailofbits/fickling/pull/210 (file handling bypasses); "
          + PICKLESCAN_SCANNER, ("write_file",), PICKLE, ".pkl",
          _pkl(lambda m: call(glob("distutils.file_util", "write_file"), s(m), EMPTY_LIST)),
          needs=("distutils.file_util.write_file",)),
    _Spec("io_fileio", "_io.FileIO(marker, 'w') creates a file",
          "https://github.com/trailofbits/fickling/pull/210 (file handling bypasses)",
          ("_io.FileIO",), PICKLE, ".pkl",
          _pkl(lambda m: call(glob("_io", "FileIO"), s(m), s("w")))),
    _Spec("broken_stream_after_payload", "the payload runs, then the stream breaks (an "
          "invalid opcode) so scanners that give up on errors report nothing",
          "nullifAI, https://safeguard.sh/resources/blog/nullifai-broken-pickles-huggingface-"
          "attack; EDP, arXiv:2508.19774", ("os.system",), PICKLE, ".pkl",
          lambda m: proto(2) + call(glob("os", "system"), s(shell(m))) + POP + b"\xff"),
    _Spec("pickle_named_bin", "a plain pickle saved as pytorch_model.bin (scanners that pick "
          "the reader by extension skip it; torch.load reads it)",
          "CVE-2025-10155 (JFrog, picklescan); GHSA-769v-p64c-89pr", ("profile.run",), TORCH,
          ".bin", _pkl(lambda m: call(glob("profile", "run"), s(code(m))))),
)


def build(outdir: Path | str) -> list[Case]:
    """Write every corpus file into ``outdir`` (created) and return the cases.

    Args:
        outdir: directory for the files.

    Returns:
        One :class:`Case` per technique, in a fixed order.
    """
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for spec in SPECS:
        marker = f"MARKER_{spec.name}"
        path = out / f"{spec.name}{spec.ext}"
        path.write_bytes(spec.make(marker))
        cases.append(Case(spec.name, path, spec.technique, spec.source, spec.expect,
                          spec.loader, marker, spec.needs, spec.works_if))
    return cases


def main(argv: list[str]) -> int:
    """``python -m tests.helpers.pickle_corpus OUTDIR``: write the corpus, list it."""
    if len(argv) != 1:
        print("usage: python -m tests.helpers.pickle_corpus OUTDIR", file=sys.stderr)
        return 2
    for case in build(argv[0]):
        print(f"{case.path}\t{case.loader}\t{','.join(case.expect)}\t{case.technique}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
