"""Every statement of the rank order and of the data-parallel degree agrees with the code, so that
the next parallelism cannot leave one stale.

What the code says, read from the code itself (nothing here names the axes or their order):

- the rank order: ``build_groups`` (``model/parallel/groups.py``) run for a fake world with a
  different prime degree on every axis (the axes: ``ParallelGroups``' ``*_rank`` fields); an
  axis's stride is the distance between the first two ranks of rank 0's group along it, and the
  order, fastest first, is the axes by stride;
- the data-parallel degree: the degrees that divide ``ParallelDims.dp``
  (``model/parallel/dims.py``): each integer degree field set to 2 in turn halves dp or not;
- DeepSpeed's data-parallel group (which ZeRO shards over, which averages the gradients, whose
  size the loss scale undoes): the axes of ``ParallelGroups.get_data_parallel_world_size()``
  with prime degrees; the pipeline topology's ``num_dp``/``num_mp``/``num_pp``: the axes of the
  ``PipeModelDataParallelTopology(...)`` call in ``training/engine/pipeline.py``.

Where the statements are read: README.md, ``ds_configs/README.md``, ``benchmarks/README.md``,
every page under ``docs/``, the strings and comments of ``launch/estimate_memory.py``,
``planning/*.py`` and ``model/parallel/*.py``, and what ``launch/estimate_memory.py`` prints
(with and without context parallelism). The forms recognised, within one sentence:

- an order: "order tp, ep, cp, dp, pp", "rank order: tp fastest, then ep, ...", "Ranks are
  numbered tp fastest, then ep, then dp, then pp" (three axes or more after "order", "ordered",
  "numbered", "fastest" or "slowest"; "slowest first" reads backwards): it must name every axis,
  in the code's order;
- the rank formula ``rank = (((pp_rank x dp + dp_rank) x cp + ...) x tp + tp_rank``: its
  ``*_rank`` terms, innermost last, and its multipliers, the same order (an "mp rank = ..." is
  another rank);
- a degree: ``LHS = world / (a x b x c)`` (also ``world_size``, ``GPUs``, ``gpus``, long names
  such as ``tensor_parallel_size`` or "tensor x expert x pipeline parallel sizes"), where LHS is
  ``dp``, ``dp x cp``, "the data-parallel size", "ZeRO's data-parallel group", ...: the LHS and
  the divisors together must be every axis, each once; "data parallelism takes what a x b
  leaves": a x b must be every model-parallel degree;
- the pipeline topology: ``num_dp = ...`` (and ``num_mp``, ``num_pp``) as the code builds it;
- the loss scale and DeepSpeed's average: "``dp / N_step``", "the loss is scaled by ...",
  "DeepSpeed averages the gradients over ...": DeepSpeed's data-parallel group (the router
  loss's own scale is not this one).

A statement about another framework is not this trainer's: one in a sentence that names
Megatron or torchtitan before it, one followed by "(this trainer: ...)", a scale followed by
"instead of".
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import inspect
import io
import math
import re
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

from tests.test_docs import DOCS, REPO

PY_SOURCES = sorted([REPO / "launch" / "estimate_memory.py", *(REPO / "planning").glob("*.py"),
                     *(REPO / "model" / "parallel").glob("*.py")])
# What launch/estimate_memory.py prints: a layout with context parallelism and one without.
PRINTOUTS = [["--recipe", "recipes/long_context_7b.yaml", "--config", "ds_configs/zero1.json", "--gpus", "16"],
             ["--recipe", "recipes/tiny_mixtral.yaml", "--config", "ds_configs/zero1.json", "--gpus", "8"]]
OTHERS = re.compile(r"\b(?:Megatron|torchtitan|Megatron-Core|Megatron-LM|DeepSpeed's own)\b")
OURS = re.compile(r"\bthis (?:trainer|repository|repo)\b")


# ----------------------------------------------------------------------------- what the code says


@dataclasses.dataclass(frozen=True)
class Code:
    order: tuple[str, ...]           # the rank order, fastest first
    divisors: frozenset[str]         # the degrees ParallelDims.dp divides the world by
    deepspeed_dp: frozenset[str]     # the axes of DeepSpeed's data-parallel group
    topology: dict                   # num_dp / num_mp / num_pp -> axes
    long_names: dict                 # "tensor" -> "tp", ...


def _axes_of(size: int, primes: dict[str, int]) -> frozenset[str]:
    return frozenset(a for a, p in primes.items() if size % p == 0)


class _FakeDist:
    """Enough of ``torch.distributed`` for ``build_groups`` to lay out a world it never joins."""

    def __init__(self, world: int):
        self.world = world

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_world_size(self):
        return self.world

    def get_rank(self):
        return 0

    def new_group(self, ranks, timeout=None):
        return object()


@lru_cache(maxsize=1)
def code() -> Code:
    import ast

    from model.parallel import groups as groups_module
    from model.parallel.dims import ParallelDims
    from model.parallel.groups import ParallelGroups

    axes = [f.name[:-len("_rank")] for f in dataclasses.fields(ParallelGroups) if f.name.endswith("_rank")]
    primes = dict(zip(axes, (2, 3, 5, 7, 11, 13, 17, 19)))
    assert len(primes) == len(axes), "more axes than primes here"
    accepted = inspect.signature(groups_module.build_groups).parameters
    given = {a: p for a, p in primes.items() if a in accepted}        # dp is what the world leaves
    world = math.prod(primes.values())
    original = groups_module.dist
    groups_module.dist = _FakeDist(world)
    try:
        built = groups_module.build_groups(**given)
    finally:
        groups_module.dist = original
    strides = {}
    for axis in axes:
        assert getattr(built, axis) == primes[axis], (axis, getattr(built, axis))
        ranks = built._ranks[axis]
        strides[axis] = ranks[1] - ranks[0]
    order = tuple(sorted(axes, key=strides.get))
    assert [strides[a] for a in order] == [math.prod(primes[b] for b in order[:i]) for i in range(len(order))], \
        f"groups.py's layout is not one axis after another: strides {strides}"

    degree_fields = [f.name for f in dataclasses.fields(ParallelDims)
                     if f.default == 1 and f.type in (int, "int")]
    divisors = frozenset(f for f in degree_fields
                         if ParallelDims(world_size=16, **{f: 2}).dp == 8)
    assert set(order) == divisors | {"dp"}, \
        f"groups.py's axes {order} are not dims.py's degrees {sorted(divisors)} and dp"

    layout = ParallelGroups(**primes)
    deepspeed_dp = _axes_of(layout.get_data_parallel_world_size(), primes)

    topology = {}
    tree = ast.parse((REPO / "training" / "engine" / "pipeline.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) \
                == "PipeModelDataParallelTopology":
            for kw in node.keywords:
                topology[kw.arg] = frozenset(n.attr for n in ast.walk(kw.value)
                                             if isinstance(n, ast.Attribute) and n.attr in primes)
    assert topology.get("num_dp"), "training/engine/pipeline.py builds no PipeModelDataParallelTopology"

    dims_source = (REPO / "model" / "parallel" / "dims.py").read_text(encoding="utf-8")
    long_names = {name: axis for name, axis in
                  re.findall(r'\("(\w+?)_parallel_size", self\.(\w+)\)', dims_source)}
    long_names["data"] = "dp"
    assert set(long_names.values()) == set(order), long_names
    return Code(order, divisors, deepspeed_dp, topology, long_names)


# ----------------------------------------------------------------------------- reading statements


def _normalise(text: str) -> str:
    """``text`` with markup and line breaks as spaces and blank lines as '¶', offset for offset."""
    text = re.sub(r"\n[ \t]*(?=\n)", lambda m: "¶" * len(m.group()), text)
    text = re.sub(r"\*\*|[`\\]", lambda m: " " * len(m.group()), text)
    return re.sub(r"\s", " ", text)


def _sentence_starts(text: str) -> list[int]:
    starts = [0] + [m.end() for m in re.finditer(r"[.!?](?=\s+[A-Z(\[])|[¶|]", text)]
    return sorted(set(starts))


def _axis_words(span: str, c: Code) -> list[str]:
    """The axes ``span`` names, in order: ``tp``, or a long name (``tensor_parallel_size``)."""
    out = []
    for word in re.findall(r"[A-Za-z_]+", span):
        word = word.lower()
        if word in c.order:
            out.append(word)
        elif word.split("_")[0] in c.long_names:
            out.append(c.long_names[word.split("_")[0]])
    return out


def statement_problems(text: str, where: str = "text") -> list[str]:
    """Every statement of the rank order, the data-parallel degree, the pipeline topology or the
    loss scale in ``text`` that disagrees with the code, as ``where:line: statement: why``."""
    c = code()
    original, text = text, _normalise(text)
    starts = _sentence_starts(text)
    ax = "(?:" + "|".join(c.order) + ")"
    prod = rf"\b{ax}\b(?:\s*[x*×]\s*\b{ax}\b)*"
    full = ", ".join(c.order)
    dp_axis = next(a for a in c.order if a not in c.divisors)
    out = []

    def product(axes) -> str:                     # "dp x cp": dp first, then fastest first
        return " x ".join(sorted(axes, key=lambda a: (a != dp_axis, c.order.index(a))))

    def report(start: int, end: int, why: str) -> None:
        out.append(f"{where}:{original.count(chr(10), 0, start) + 1}: '{' '.join(text[start:end].split())}': {why}")

    def sentence_before(pos: int) -> str:
        return text[starts[bisect.bisect_right(starts, pos) - 1]:pos]

    def others(pos: int) -> bool:
        before = sentence_before(pos)
        named = list(OTHERS.finditer(before))
        return bool(named) and not OURS.search(before[named[-1].end():])

    # The rank order as a list.
    sep = r"(?:\s*,\s*(?:and\s+)?(?:then\s+)?|\s+(?:and\s+)?then\s+|\s+and\s+|\s*(?:->|→|<|>)\s*)"
    listing = re.compile(rf"\b{ax}\b(?:\s+fastest)?(?:{sep}\b{ax}\b)+")
    for m in listing.finditer(text):
        axes = _axis_words(m.group(), c)
        before = sentence_before(m.start())
        trigger = list(re.finditer(r"\b(?:order|ordered|numbered|fastest|slowest)\b", before + m.group()))
        if len(axes) < 3 or not trigger or others(m.start()) \
                or re.match(r"\s*\(this (?:trainer|repository|repo)\b", text[m.end():]):
            continue
        end = re.match(r"\s+(fastest|slowest)\b", text[m.end():])
        if end and len(axes) > len(set(axes)):          # "order tp, ep, ..., pp, tp fastest"
            named, axes = axes[-1], axes[:-1]
            if named != c.order[0 if end.group(1) == "fastest" else -1]:
                report(m.start(), m.end() + end.end(), f"the {end.group(1)} axis is "
                                                       f"{c.order[0 if end.group(1) == 'fastest' else -1]}")
        if re.search(r"slowest[^.]{0,20}$", before):
            axes = axes[::-1]
        if tuple(axes) != c.order:
            missing = [a for a in c.order if a not in axes]
            why = f"leaves out {', '.join(missing)}" if missing else "not the order"
            report(m.start(), m.end(), f"{why}; the rank order is {full} (model/parallel/groups.py)")

    # The rank formula.
    for m in re.finditer(rf"\brank\s*=\s*\(*\s*{ax}_rank\b(?:[^=¶]*?\b{ax}_rank\b)+", text):
        if re.search(rf"\b(?:{ax}|mp|local|node|model[- ]parallel|data[- ]parallel)[ _-]$", text[:m.start()]):
            continue                                  # "mp rank = ep_rank * tp + tp_rank": not the rank
        terms = re.findall(rf"\b({ax})_rank\b", m.group())[::-1]
        multipliers = re.findall(rf"[x*×]\s*\b({ax})\b(?!_)", m.group())[::-1]
        if tuple(terms) != c.order or tuple(multipliers) != c.order[:-1]:
            report(m.start(), m.end(), f"the rank order is {full}, fastest first (model/parallel/groups.py)")

    # The data-parallel degree.
    for m in re.finditer(r"\b(?:world_size|world|WORLD_SIZE|GPUs|gpus)\s*/\s*\(([^()]*)\)", text):
        before = text[max(0, m.start() - 80):m.start()]
        named = re.search(rf"\b({ax}(?:\s*[x*×]?\s*{ax})*)\s*(?:\d+\s*)?\(?\s*(?:=|is)\s*$", before)
        if named and dp_axis in _axis_words(named.group(1), c):          # dp = ..., dp x cp = ...
            lhs, start = set(_axis_words(named.group(1), c)), m.start() - len(before) + named.start()
        elif re.search(r"\b(?:ZeRO's|DeepSpeed's) data[- ]parallel (?:group|size)\s*(?:=|is)\s*$", before):
            lhs, start = set(c.deepspeed_dp), m.start()
        elif re.search(r"\bdata[- ]parallel (?:size|degree)\s*(?:=|is)\s*$", before):
            lhs, start = {dp_axis}, m.start()
        else:
            continue
        if others(m.start()):
            continue
        divisors = _axis_words(m.group(1), c)
        want = sorted(c.divisors - lhs, key=c.order.index)
        if sorted(divisors, key=c.order.index) != want:
            missing = [a for a in want if a not in divisors]
            why = f"leaves out {', '.join(missing)}" if missing else "divides by the wrong degrees"
            report(start, m.end(), f"{why}: {product(lhs)} = world / "
                                   f"({' x '.join(want)}) (model/parallel/dims.py)")
    for m in re.finditer(r"data[- ]parallel\w* takes what (.{1,80}?) leaves", text):
        if sorted(_axis_words(m.group(1), c)) != sorted(c.divisors):
            report(m.start(), m.end(), f"dp is what {product(c.divisors)} "
                                       f"leaves (model/parallel/dims.py)")

    # The pipeline topology.
    for m in re.finditer(rf"\b(num_(?:dp|mp|pp))\s*=\s*({prod})", text):
        want = c.topology.get(m.group(1))
        if want is not None and set(_axis_words(m.group(2), c)) != want:
            report(m.start(), m.end(), f"{m.group(1)} = {product(want)} "
                                       f"(training/engine/pipeline.py)")

    # The loss scale and DeepSpeed's average: DeepSpeed's data-parallel group.
    group = product(c.deepspeed_dp)
    scales = [rf"({prod})\s*/\s*(?:N\w*|step_tokens|tokens\w*|\(the step's tokens\))",
              rf"(?<!router )\bloss(?:es)?\s+(?:is\s+|are\s+)?(?:scaled|multiplied)\s+by\s+({prod})",
              rf"\bscales?\s+(?:each\s+rank's\s+|the\s+)?loss(?:es)?\s+by\s+({prod})",
              rf"\baverages?\s+(?:the\s+)?gradients\s+over\s+(?:the\s+)?({prod})"]
    for pattern in scales:
        for m in re.finditer(pattern, text):
            if re.match(r"\s*(?:instead|rather)\b", text[m.end():]) or others(m.start()):
                continue
            if set(_axis_words(m.group(1), c)) != c.deepspeed_dp:
                report(m.start(), m.end(), f"DeepSpeed's data-parallel group is {group} "
                                           f"(model/parallel/groups.py): the scale is {group}")
    return out


def _python_text(path: Path) -> str:
    """``path``'s strings and comments in place, everything else blanked (offsets kept); an
    f-string's fields read as a number."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    out = [ch if ch == "\n" else " " for ch in source]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        start = offsets[tok.start[0] - 1] + tok.start[1]
        body = tok.string
        if tok.type == tokenize.STRING:
            prefix = re.match(r"^[A-Za-z]*", body).group()
            body = re.sub(r"^[A-Za-z]*('''|\"\"\"|'|\")", lambda m: " " * len(m.group()), body)
            body = re.sub(r"('''|\"\"\"|'|\")$", lambda m: " " * len(m.group()), body)
            if "f" in prefix.lower():
                body = re.sub(r"\{[^{}]*\}", lambda m: "8" + " " * (len(m.group()) - 1), body)
        else:
            body = " " + body[1:]
        out[start:start + len(body)] = body
    return "".join(out)


def _printout(args: list[str]) -> str:
    from launch import estimate_memory
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert estimate_memory.main(args) == 0
    return buffer.getvalue()


SOURCES = [*DOCS, *PY_SOURCES]


@pytest.mark.parametrize("path", SOURCES, ids=[p.relative_to(REPO).as_posix() for p in SOURCES])
def test_every_rank_order_and_dp_statement_agrees_with_the_code(path):
    text = _python_text(path) if path.suffix == ".py" else path.read_text(encoding="utf-8")
    problems = statement_problems(text, path.relative_to(REPO).as_posix())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("args", PRINTOUTS, ids=[a[1] for a in PRINTOUTS])
def test_what_estimate_memory_prints_agrees_with_the_code(args):
    problems = statement_problems(_printout(args), "launch/estimate_memory.py " + " ".join(args))
    assert not problems, "\n".join(problems)


def test_the_code_reads_as_expected():
    """What the checks compare with, as the code has it today (a change here is a change of the
    code that every page must follow: this test says which statement to rewrite)."""
    c = code()
    assert set(c.order) >= {"tp", "dp", "pp"} and c.order[0] == "tp" and c.order[-1] == "pp"
    assert c.divisors == set(c.order) - {"dp"}
    assert "dp" in c.deepspeed_dp and c.topology["num_dp"] == c.deepspeed_dp


def test_a_statement_that_leaves_out_a_parallel_dimension_is_reported():
    c = code()
    axes = list(c.order)
    dropped = next(a for a in axes if a in c.divisors and a not in ("tp", "pp"))   # cp today
    short = [a for a in axes if a != dropped]
    divisors = [a for a in axes if a in c.divisors]
    cases = [f"Ranks are in the order {', '.join(short)}.",
             f"    dp = world_size / ({' x '.join(a for a in divisors if a != dropped)})\n"]
    for text in cases:
        found = statement_problems(text)
        assert len(found) == 1 and f"leaves out {dropped}" in found[0], (text, found)
    # the forms the pages use, whole: nothing to report
    good = (f"Data parallelism takes the remaining ranks (order {', '.join(axes)}).\n\n"
            f"Ranks are numbered {axes[0]}\nfastest, then {', '.join(axes[1:])} (`build_groups`).\n\n"
            f"The ranks are numbered in the order {', '.join(axes)}, {axes[0]}\nfastest.\n\n"
            f"    dp = world_size / ({' x '.join(divisors)})\n\n"
            f"the data-parallel size dp = GPUs / ({' x '.join(divisors)}), and ZeRO shards over dp x cp = "
            f"world / ({' x '.join(a for a in divisors if a != 'cp')}).\n\n"
            f"rank = " + "(" * (len(axes) - 2) + f"{axes[-1]}_rank"
            + "".join(f" x {a} + {a}_rank)" for a in reversed(axes[:-1]))[:-1] + "\n\n"
            f"The loss is scaled by dp x cp, `ce_sum * dp x cp / N_step`; DeepSpeed averages the "
            f"gradients over dp x cp. A loss scaled by dp instead of dp x cp halves the gradient.\n\n"
            f"Megatron and torchtitan: dense parameters over dp cp = world / (tp pp). The planner's "
            f"rank order: tp, cp, ep, dp, pp (this trainer: {', '.join(axes)}).\n")
    assert statement_problems(good) == [], statement_problems(good)
    # and the stale forms of the same statements are reported, one each
    stale = {"order": "(order tp, ep, dp, pp)",
             "then": "Ranks are ordered tp fastest, then ep, then dp, then pp.",
             "dp/N": "loss_b = ce_sum_b * dp / N_step + router_loss_b / gas",
             "switch": "the data-parallel size is GPUs / (tp x ep x pp), and",
             "long": "dp = world_size / (tensor x expert x pipeline parallel sizes)",
             "printout": "ZeRO-1 over dp 16 (= gpus / (tp ep pp), dp x cp) | bf16",
             "topology": "`PipeModelDataParallelTopology(num_pp=pp, num_mp=tp x ep, num_dp=dp)`",
             "average": "DeepSpeed averages gradients over the `dp` data-parallel ranks",
             "formula": "rank = ((pp_rank * dp + dp_rank) * ep + ep_rank) * tp + tp_rank",
             "ours": "rank order: tp fastest, then cp, ep, dp, pp (this trainer: tp, ep, dp, pp).",
             "named": "Ranks are numbered in the order tp, ep, cp, dp, pp, pp fastest.",
             "last": "The ranks are in the order tp, ep, dp, pp, tp fastest."}
    assert statement_problems("(mp rank = ep_rank * tp + tp_rank) and the router loss is multiplied by cp") == []
    if "cp" in c.order:
        for name, text in stale.items():
            assert len(statement_problems(text)) == 1, (name, statement_problems(text))
