"""Embedded trace tasks: a deterministic generator of small Python programs, one per task id.

`generate_program(task_id)` draws everything from `random.Random(task_id)`; the difficulty is the
task id's trace level (ppo_affine/envs/tasks.py). Level 0 is one tiny snippet (a value printed, copied, or one
arithmetic expression); from level 1 on a program is a few independent snippets, each picked from a
table of builders (loops, string and list work, dicts, functions, recursion, classes, handled
exceptions, generators, closures, stdin parsing) and filled with random names, words and numbers.
Harder levels allow more snippets, longer loops, the harder builders, and wrap the whole program
in a `main()` function more often. Every builder only writes code that terminates within a few
milliseconds and prints what it computed; none prints object addresses or string-set order.
"""
from __future__ import annotations

import functools
import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from ppo_affine.envs.tasks import TRACE_HELD_OUT, is_held_out_trace_task, trace_level_of, trace_level_range


@dataclass(frozen=True)
class TraceProgram:
    source: str
    inputs: str  # stdin, one line per `input()` call
    difficulty: int


WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pixel", "lemon", "north",
    "crane", "delta", "ember", "frost", "grape", "honey", "ivory", "jolly", "kayak", "lunar",
    "mango", "noble", "olive", "pearl", "quartz", "radar", "solar", "tulip", "umbra", "vivid",
    "wheat", "xenon", "yacht", "zebra", "bison", "cedar", "dune", "fjord", "gecko", "harbor",
)

# Role -> candidate identifiers; builders ask for a role and get an unused name.
NAMES = {
    "num": ("a", "b", "c", "x", "y", "z", "n", "m", "k", "p", "q", "val", "num", "base", "size"),
    "acc": ("total", "acc", "result", "score", "tally", "agg", "running", "out", "prod", "level"),
    "idx": ("i", "j", "k", "idx", "step", "t", "r", "pos"),
    "item": ("v", "item", "elem", "w", "e", "entry", "piece", "token"),
    "seq": ("xs", "items", "data", "nums", "values", "arr", "stack", "queue", "bag", "pool"),
    "text": ("s", "text", "word", "line", "msg", "label", "name", "tag", "code"),
    "map": ("counts", "table", "seen", "index", "lookup", "freq", "groups", "memo", "cache", "book"),
    "flag": ("ok", "found", "done", "valid", "flag", "hit"),
    "func": ("f", "g", "h", "calc", "helper", "combine", "walk", "solve", "step_fn", "apply"),
    "cls": ("Box", "Counter", "Node", "Account", "Robot", "Tracker", "Shape", "Player", "Bucket", "Gadget"),
    "attr": ("value", "total", "count", "level", "size", "energy", "score", "items", "history", "log"),
    "method": ("add", "push", "grow", "bump", "feed", "record", "update", "absorb", "shift", "charge"),
}


class _ProgramWriter:
    """Accumulates source lines, stdin lines and the names already taken by earlier snippets."""

    def __init__(self, rng: random.Random, level: int):
        self.rng = rng
        self.level = level
        self.lines: list[str] = []
        self.stdin_lines: list[str] = []
        self.used: set[str] = set()

    def name(self, role: str) -> str:
        free = [n for n in NAMES[role] if n not in self.used]
        chosen = self.rng.choice(free) if free else f"{self.rng.choice(NAMES[role])}{len(self.used)}"
        self.used.add(chosen)
        return chosen

    def small(self) -> int:
        """A loop length that grows with the difficulty."""
        return self.rng.randint(2, 3 + 2 * self.level)

    def word(self) -> str:
        return self.rng.choice(WORDS)

    def ints(self, count: int, low: int = -9, high: int = 20) -> list[int]:
        return [self.rng.randint(low, high) for _ in range(count)]

    def emit(self, block: str) -> None:
        self.lines.extend(textwrap.dedent(block).strip("\n").split("\n"))


Snippet = Callable[[_ProgramWriter], None]


def nest(code: str, spaces: int) -> str:
    """Indent the continuation lines of `code` by `spaces`: the column its first line sits at in the
    template, before `emit` dedents the template."""
    return code.replace("\n", "\n" + " " * spaces)


# ---------------------------------------------------------------- level 0: one value, one print
# A starter level for a model that cannot yet answer level 1: two or three assignments (so the env's injector,
# which may print after each assignment, usually adds a debug line) and one print of a literal, a copied
# variable or one small expression.
def print_value(w: _ProgramWriter) -> None:
    name = w.name(w.rng.choice(["num", "text"]))
    value = w.rng.randint(0, 99) if name in NAMES["num"] else w.word()
    w.emit(f"""
        {name} = {value!r}
        print({name})
    """)


def copy_value(w: _ProgramWriter) -> None:
    a, b = w.name("num"), w.name("num")
    value = w.rng.choice([w.rng.randint(0, 99), w.word()])
    w.emit(f"""
        {a} = {value!r}
        {b} = {a}
        print({w.rng.choice([b, f"{a}, {b}"])})
    """)


def one_expression(w: _ProgramWriter) -> None:
    a, b = w.name("num"), w.name("num")
    op = w.rng.choice(["+", "-", "*"])
    w.emit(f"""
        {a} = {w.rng.randint(1, 20)}
        {b} = {a} {op} {w.rng.randint(1, 9)}
        print({b})
    """)


# ---------------------------------------------------------------- level 1: straight lines and loops
def arithmetic(w: _ProgramWriter) -> None:
    a, b, c = w.name("num"), w.name("num"), w.name("num")
    op1, op2 = w.rng.choice("+-*"), w.rng.choice(["//", "%", "+", "-"])
    aug = w.rng.choice(["+=", "-=", "*="])
    w.emit(f"""
        {a} = {w.rng.randint(2, 30)}
        {b} = {a} {op1} {w.rng.randint(1, 9)}
        {c} = ({a} + {b}) {op2} {w.rng.randint(2, 7)}
        {a} {aug} {c}
        print({a}, {b}, {c})
    """)


def sum_loop(w: _ProgramWriter) -> None:
    acc, i = w.name("acc"), w.name("idx")
    start, stop = w.rng.randint(0, 3), w.rng.randint(4, 4 + 2 * w.level)
    factor, mod = w.rng.randint(1, 5), w.rng.randint(2, 4)
    body = w.rng.choice([
        f"{acc} += {i} * {factor}",
        f"{acc} = {acc} * 2 - {i}",
        f"if {i} % {mod} == 0:\n    {acc} += {i}\nelse:\n    {acc} -= {factor}",
    ])
    w.emit(f"""
        {acc} = {w.rng.randint(0, 5)}
        for {i} in range({start}, {stop}):
            {nest(body, 12)}
        print('{acc} =', {acc})
    """)


def string_build(w: _ProgramWriter) -> None:
    s, ch = w.name("text"), w.name("item")
    body = w.rng.choice([
        f"{s} = {ch} + {s}",
        f"{s} += {ch}.upper()",
        f"{s} += {ch} * 2",
        f"if {ch} in 'aeiou':\n    {s} += '*'\nelse:\n    {s} += {ch}",
    ])
    w.emit(f"""
        {s} = ''
        for {ch} in {w.word()!r}:
            {nest(body, 12)}
        print({s}, len({s}))
    """)


def list_ops(w: _ProgramWriter) -> None:
    xs = w.name("seq")
    values = w.ints(w.rng.randint(3, 3 + w.level))
    ops = w.rng.sample([
        f"{xs}.append({w.rng.randint(-5, 25)})", f"{xs}.sort()", f"{xs}.reverse()", f"{xs}.pop()",
        f"{xs}.insert(1, {w.rng.randint(0, 9)})", f"{xs} = {xs}[1:]", f"{xs} = {xs} + {xs}[:2]",
    ], 3)
    ops_text = "\n".join(ops)
    w.emit(f"{xs} = {values}\n{ops_text}\nprint({xs}, len({xs}), {xs}[0])")


def collatz(w: _ProgramWriter) -> None:
    n, steps = w.name("num"), w.name("acc")
    w.emit(f"""
        {n} = {w.rng.randint(3, 12 + 6 * w.level)}
        {steps} = 0
        while {n} != 1:
            if {n} % 2 == 0:
                {n} = {n} // 2
            else:
                {n} = 3 * {n} + 1
            {steps} += 1
        print('steps', {steps})
    """)


def fibonacci_pairs(w: _ProgramWriter) -> None:
    a, b, i = w.name("num"), w.name("num"), w.name("idx")
    show = f"\nprint({i}, {a})" if w.rng.random() < 0.5 else ""
    w.emit(f"""
        {a}, {b} = {w.rng.randint(0, 3)}, {w.rng.randint(1, 4)}
        for {i} in range({w.small()}):
            {a}, {b} = {b}, {a} + {b}{nest(show, 12)}
        print({a}, {b})
    """)


def branch(w: _ProgramWriter) -> None:
    x, y = w.name("num"), w.name("acc")
    threshold = w.rng.randint(5, 15)
    w.emit(f"""
        {x} = {w.rng.randint(0, 20)}
        {y} = 0
        if {x} > {threshold}:
            {y} = {x} - {threshold}
        elif {x} == {threshold}:
            {y} = 100
        else:
            {y} = {threshold} * 2 - {x}
        print({x}, {y})
    """)


def string_methods(w: _ProgramWriter) -> None:
    text, parts = w.name("text"), w.name("seq")
    words = [w.word() for _ in range(w.rng.randint(3, 5))]
    letter = w.rng.choice("aeiorn")
    joiner = w.rng.choice(["-", "+", "/", ""])
    shown = w.rng.choice([
        f"{joiner!r}.join(p.capitalize() for p in {parts})",
        f"{text}.replace({letter!r}, {letter.upper()!r})",
        f"[p[::-1] for p in {parts}]",
        f"{text}.title()",
    ])
    w.emit(f"""
        {text} = {' '.join(words)!r}
        {parts} = {text}.split()
        print({shown})
        print({text}.count({letter!r}), {text}.find({words[1][:2]!r}), len({parts}))
    """)


def char_counts(w: _ProgramWriter) -> None:
    counts, ch = w.name("map"), w.name("item")
    w.emit(f"""
        {counts} = {{}}
        for {ch} in {w.word() + w.word()!r}:
            {counts}[{ch}] = {counts}.get({ch}, 0) + 1
        print({counts})
    """)


def comprehension(w: _ProgramWriter) -> None:
    xs, i = w.name("seq"), w.name("idx")
    mod = w.rng.randint(2, 4)
    expr = w.rng.choice([f"{i} * {i}", f"{i} * {w.rng.randint(2, 5)} - 1", f"{i} ** 2 % 7"])
    w.emit(f"""
        {xs} = [{expr} for {i} in range({w.small() + 2}) if {i} % {mod} != 0]
        print({xs}, sum({xs}))
    """)


def min_max(w: _ProgramWriter) -> None:
    data, lo, hi, v = w.name("seq"), w.name("num"), w.name("num"), w.name("item")
    w.emit(f"""
        {data} = {w.ints(w.rng.randint(4, 4 + w.level), -20, 40)}
        {lo} = {data}[0]
        {hi} = {data}[0]
        for {v} in {data}:
            if {v} < {lo}:
                {lo} = {v}
            if {v} > {hi}:
                {hi} = {v}
        print({lo}, {hi}, {hi} - {lo})
    """)


def times_table(w: _ProgramWriter) -> None:
    i, j, row = w.name("idx"), w.name("idx"), w.name("text")
    w.emit(f"""
        for {i} in range(1, {w.rng.randint(3, 4)}):
            {row} = ''
            for {j} in range(1, {w.rng.randint(3, 5)}):
                {row} += str({i} * {j}) + ' '
            print({row}.strip())
    """)


# ---------------------------------------------------------------- level 2: functions and data work
def function_with_default(w: _ProgramWriter) -> None:
    f, p, q, r = w.name("func"), w.name("num"), w.name("num"), w.name("acc")
    w.emit(f"""
        def {f}({p}, {q}={w.rng.randint(1, 5)}):
            {r} = {p} * {q} + {w.rng.randint(0, 9)}
            if {r} % 2 == 0:
                {r} = {r} // 2
            return {r}
        print({f}({w.rng.randint(1, 9)}), {f}({w.rng.randint(1, 9)}, {w.rng.randint(2, 6)}))
    """)


def gcd_function(w: _ProgramWriter) -> None:
    f, a, b = w.name("func"), w.name("num"), w.name("num")
    pairs = [(w.rng.randint(4, 60), w.rng.randint(4, 60)) for _ in range(3)]
    w.emit(f"""
        def {f}({a}, {b}):
            while {b}:
                {a}, {b} = {b}, {a} % {b}
            return {a}
        for {a}, {b} in {pairs}:
            print({a}, {b}, {f}({a}, {b}))
    """)


def primes(w: _ProgramWriter) -> None:
    f, n, d, ps, k = w.name("func"), w.name("num"), w.name("idx"), w.name("seq"), w.name("item")
    low = w.rng.randint(2, 20)
    w.emit(f"""
        def {f}({n}):
            if {n} < 2:
                return False
            for {d} in range(2, int({n} ** 0.5) + 1):
                if {n} % {d} == 0:
                    return False
            return True
        {ps} = [{k} for {k} in range({low}, {low + w.rng.randint(10, 25)}) if {f}({k})]
        print({ps})
    """)


def matrix(w: _ProgramWriter) -> None:
    m, sums, cols = w.name("seq"), w.name("seq"), w.name("seq")
    rows = [w.ints(3, 0, 9) for _ in range(w.rng.randint(2, 3))]
    w.emit(f"""
        {m} = {rows}
        {sums} = [sum(row) for row in {m}]
        {cols} = [list(col) for col in zip(*{m})]
        print({sums}, {cols}[{w.rng.randint(0, 2)}], max({sums}))
    """)


def sort_words(w: _ProgramWriter) -> None:
    ws = w.name("seq")
    words = [w.word() for _ in range(w.rng.randint(4, 6))]
    call = w.rng.choice([
        f"{ws}.sort(key=lambda s: (len(s), s))",
        f"{ws} = sorted({ws}, key=lambda s: s[-1])",
        f"{ws}.sort(reverse=True)",
        f"{ws} = sorted(set({ws}))",
    ])
    w.emit(f"{ws} = {words}\n{call}\nprint({ws})")


def bracket_check(w: _ProgramWriter) -> None:
    stack, ok, ch = w.name("seq"), w.name("flag"), w.name("item")
    text = w.rng.choice(["([]{})", "(()", "{[()()]}", "([)]", "((a+b)*[c])", "}{", "[{}]()"])
    w.emit(f"""
        {stack} = []
        {ok} = True
        for {ch} in {text!r}:
            if {ch} in '([{{':
                {stack}.append({ch})
            elif {ch} in ')]}}':
                if not {stack} or '([{{'.index({stack}[-1]) != ')]}}'.index({ch}):
                    {ok} = False
                    break
                {stack}.pop()
        print({text!r}, {ok} and not {stack})
    """)


def to_binary(w: _ProgramWriter) -> None:
    n, bits = w.name("num"), w.name("text")
    value = w.rng.randint(5, 200)
    w.emit(f"""
        {n} = {value}
        {bits} = ''
        while {n} > 0:
            {bits} = str({n} % 2) + {bits}
            {n} //= 2
        print({bits}, {bits}.count('1'))
    """)


def zip_enumerate(w: _ProgramWriter) -> None:
    names, scores, i, nm, sc = w.name("seq"), w.name("seq"), w.name("idx"), w.name("text"), w.name("num")
    count = w.rng.randint(3, 4 + w.level)
    cut = w.rng.randint(40, 70)
    w.emit(f"""
        {names} = {[w.word() for _ in range(count)]}
        {scores} = {w.ints(count, 10, 99)}
        for {i}, ({nm}, {sc}) in enumerate(zip({names}, {scores})):
            if {sc} >= {cut}:
                print({i}, {nm}, 'pass')
            else:
                print({i}, {nm}, 'fail', {cut} - {sc})
    """)


def stdin_numbers(w: _ProgramWriter) -> None:
    n, nums, acc, x = w.name("num"), w.name("seq"), w.name("acc"), w.name("item")
    values = w.ints(w.rng.randint(3, 5 + w.level), -10, 30)
    w.stdin_lines += [str(len(values)), " ".join(map(str, values))]
    w.emit(f"""
        {n} = int(input())
        {nums} = list(map(int, input().split()))
        {acc} = 0
        for {x} in {nums}[:{n}]:
            if {x} > 0:
                {acc} += {x}
        print({n}, {acc}, max({nums}))
    """)


def while_break(w: _ProgramWriter) -> None:
    i, found = w.name("idx"), w.name("num")
    skip, target = w.rng.randint(2, 4), w.rng.randint(10, 60)
    w.emit(f"""
        {i} = 0
        {found} = -1
        while {i} < 50:
            {i} += 1
            if {i} % {skip} == 0:
                continue
            if {i} * {i} > {target}:
                {found} = {i}
                break
        print({i}, {found})
    """)


def grouping(w: _ProgramWriter) -> None:
    groups, item, key = w.name("map"), w.name("item"), w.name("text")
    words = [w.word() for _ in range(w.rng.randint(4, 6))]
    key_expr = w.rng.choice([f"len({item})", f"{item}[0]", f"{item}[-1]"])
    w.emit(f"""
        {groups} = {{}}
        for {item} in {words}:
            {key} = {key_expr}
            {groups}.setdefault({key}, []).append({item})
        for {key} in sorted({groups}):
            print({key}, {groups}[{key}])
    """)


def bubble_sort(w: _ProgramWriter) -> None:
    xs, swaps, i, j = w.name("seq"), w.name("acc"), w.name("idx"), w.name("idx")
    w.emit(f"""
        {xs} = {w.ints(w.rng.randint(4, 6), 0, 30)}
        {swaps} = 0
        for {i} in range(len({xs})):
            for {j} in range(len({xs}) - 1 - {i}):
                if {xs}[{j}] > {xs}[{j} + 1]:
                    {xs}[{j}], {xs}[{j} + 1] = {xs}[{j} + 1], {xs}[{j}]
                    {swaps} += 1
        print({xs}, {swaps})
    """)


def binary_search(w: _ProgramWriter) -> None:
    xs, lo, hi, mid, target = w.name("seq"), w.name("num"), w.name("num"), w.name("idx"), w.name("item")
    values = sorted(set(w.ints(8, 0, 50)))
    wanted = w.rng.choice(values + [51, -1])
    w.emit(f"""
        {xs} = {values}
        {target} = {wanted}
        {lo}, {hi} = 0, len({xs}) - 1
        while {lo} <= {hi}:
            {mid} = ({lo} + {hi}) // 2
            if {xs}[{mid}] == {target}:
                break
            if {xs}[{mid}] < {target}:
                {lo} = {mid} + 1
            else:
                {hi} = {mid} - 1
        print({lo}, {hi}, {lo} <= {hi})
    """)


def run_length(w: _ProgramWriter) -> None:
    text, out, ch, run = w.name("text"), w.name("seq"), w.name("item"), w.name("num")
    source = "".join(w.rng.choice("aab") * w.rng.randint(1, 3) for _ in range(w.rng.randint(3, 6)))
    w.emit(f"""
        {text} = {source!r}
        {out} = []
        {run} = 1
        for {ch} in range(1, len({text}) + 1):
            if {ch} < len({text}) and {text}[{ch}] == {text}[{ch} - 1]:
                {run} += 1
            else:
                {out}.append({text}[{ch} - 1] + str({run}))
                {run} = 1
        print(''.join({out}))
    """)


def formatted_table(w: _ProgramWriter) -> None:
    rows, nm, qty, price = w.name("seq"), w.name("text"), w.name("num"), w.name("num")
    items = [(w.word(), w.rng.randint(1, 9), round(w.rng.uniform(0.5, 20), 2)) for _ in range(w.rng.randint(2, 4))]
    w.emit(f"""
        {rows} = {items}
        for {nm}, {qty}, {price} in {rows}:
            print(f'{{{nm}:>8}}|{{{qty}:3d}}|{{{qty} * {price}:8.2f}}')
    """)


def conditional_assignment(w: _ProgramWriter) -> None:
    # A name bound only inside a branch: a debug print placed after the `if` may crash on it when the
    # branch is not taken, as the real env's injected prints do on its dataset.
    x, extra = w.name("num"), w.name("acc")
    threshold = w.rng.randint(5, 15)
    w.emit(f"""
        {x} = {w.rng.randint(0, 20)}
        if {x} > {threshold}:
            {extra} = {x} - {threshold}
            print('over by', {extra})
        {x} += {w.rng.randint(1, 4)}
        print({x})
    """)


# ---------------------------------------------------------------- level 3: recursion, classes, exceptions
def recursion(w: _ProgramWriter) -> None:
    f, n = w.name("func"), w.name("num")
    body, arg = w.rng.choice([
        (f"if {n} <= 1:\n    return 1\nreturn {n} * {f}({n} - 1)", w.rng.randint(3, 8)),
        (f"if {n} < 10:\n    return {n}\nreturn {n} % 10 + {f}({n} // 10)", w.rng.randint(100, 99999)),
        (f"if {n} == 0:\n    return ''\nreturn {f}({n} // 3) + str({n} % 3)", w.rng.randint(5, 200)),
        (f"if {n} <= 2:\n    return {n}\nreturn {f}({n} - 1) + {f}({n} - 2)", w.rng.randint(3, 9)),
    ])
    w.emit(f"""
        def {f}({n}):
            {nest(body, 12)}
        print({f}({arg}))
    """)


def memo_fibonacci(w: _ProgramWriter) -> None:
    memo, f, n, r = w.name("map"), w.name("func"), w.name("num"), w.name("acc")
    w.emit(f"""
        {memo} = {{}}
        def {f}({n}):
            if {n} in {memo}:
                return {memo}[{n}]
            if {n} < 2:
                {r} = {n}
            else:
                {r} = {f}({n} - 1) + {f}({n} - 2)
            {memo}[{n}] = {r}
            return {r}
        print({f}({w.rng.randint(8, 25)}), len({memo}))
    """)


def class_counter(w: _ProgramWriter) -> None:
    cls, attr, hist, method = w.name("cls"), w.name("attr"), w.name("attr"), w.name("method")
    v, obj, k = w.name("item"), w.name("text"), w.name("idx")
    w.emit(f"""
        class {cls}:
            def __init__(self, start):
                self.{attr} = start
                self.{hist} = []
            def {method}(self, {v}):
                self.{attr} += {v}
                self.{hist}.append({v})
                return self.{attr}
        {obj} = {cls}({w.rng.randint(0, 10)})
        for {k} in range({w.small()}):
            {obj}.{method}({k} * {w.rng.randint(1, 4)} - {w.rng.randint(0, 3)})
        print({obj}.{attr}, {obj}.{hist})
    """)


def inheritance(w: _ProgramWriter) -> None:
    base, sub, obj = w.name("cls"), w.name("cls"), w.name("item")
    verb, extra = w.rng.choice(["hums", "beeps", "sings", "counts"]), w.rng.randint(1, 5)
    w.emit(f"""
        class {base}:
            def __init__(self, name, power):
                self.name = name
                self.power = power
            def describe(self):
                return self.name + ' ' + str(self.power)
        class {sub}({base}):
            def describe(self):
                self.power += {extra}
                return super().describe() + ' {verb}'
        for {obj} in [{base}({w.word()!r}, {w.rng.randint(1, 9)}), {sub}({w.word()!r}, {w.rng.randint(1, 9)})]:
            print({obj}.describe(), type({obj}).__name__)
    """)


def handled_exceptions(w: _ProgramWriter) -> None:
    f, a, b = w.name("func"), w.name("num"), w.name("num")
    pairs = [(w.rng.randint(-5, 30), w.rng.choice([0, w.rng.randint(1, 6)])) for _ in range(3)]
    w.emit(f"""
        def {f}({a}, {b}):
            try:
                return {a} // {b}
            except ZeroDivisionError:
                return None
            finally:
                print('tried', {a}, {b})
        for {a}, {b} in {pairs}:
            print({f}({a}, {b}))
    """)


def parse_tokens(w: _ProgramWriter) -> None:
    tokens, good, tok = w.name("seq"), w.name("seq"), w.name("item")
    pool = [str(w.rng.randint(-20, 99)) for _ in range(3)] + [w.word(), "3.5", ""]
    w.rng.shuffle(pool)
    w.emit(f"""
        {tokens} = {pool}
        {good} = []
        for {tok} in {tokens}:
            try:
                {good}.append(int({tok}))
            except ValueError as err:
                print('skip', repr({tok}))
        print({good}, sum({good}))
    """)


def custom_exception(w: _ProgramWriter) -> None:
    err, f, balance, amounts, amount = w.name("cls"), w.name("func"), w.name("acc"), w.name("seq"), w.name("num")
    w.emit(f"""
        class {err}Error(Exception):
            pass
        def {f}(current, amount):
            if amount > current:
                raise {err}Error('short by ' + str(amount - current))
            return current - amount
        {balance} = {w.rng.randint(20, 60)}
        {amounts} = {w.ints(w.rng.randint(3, 5), 5, 30)}
        for {amount} in {amounts}:
            try:
                {balance} = {f}({balance}, {amount})
            except {err}Error as exc:
                print('refused:', exc)
        print('left', {balance})
    """)


def key_lookup(w: _ProgramWriter) -> None:
    table, key, hits = w.name("map"), w.name("text"), w.name("acc")
    keys = [w.word() for _ in range(3)]
    queries = w.rng.sample(keys + [w.word(), w.word()], 4)
    w.emit(f"""
        {table} = {dict(zip(keys, w.ints(3, 1, 9)))}
        {hits} = 0
        for {key} in {queries}:
            try:
                {hits} += {table}[{key}]
            except KeyError:
                print('missing', {key})
        print({hits})
    """)


def generator(w: _ProgramWriter) -> None:
    gen, limit, v = w.name("func"), w.name("num"), w.name("item")
    factor = w.rng.randint(2, 4)
    w.emit(f"""
        def {gen}({limit}):
            {v} = {w.rng.randint(1, 3)}
            while {v} < {limit}:
                yield {v}
                {v} = {v} * {factor} + 1
        print(list({gen}({w.rng.randint(20, 300)})))
    """)


def closure(w: _ProgramWriter) -> None:
    make, inner, count, step, c = w.name("func"), w.name("func"), w.name("acc"), w.name("num"), w.name("item")
    calls = ", ".join(f"{c}()" for _ in range(w.rng.randint(2, 4)))
    w.emit(f"""
        def {make}({step}):
            {count} = {w.rng.randint(0, 5)}
            def {inner}():
                nonlocal {count}
                {count} += {step}
                return {count}
            return {inner}
        {c} = {make}({w.rng.randint(1, 7)})
        print({calls})
    """)


def stdin_table(w: _ProgramWriter) -> None:
    n, table, key, val, query = w.name("num"), w.name("map"), w.name("text"), w.name("item"), w.name("text")
    keys = list(dict.fromkeys(w.word() for _ in range(w.rng.randint(2, 4))))
    w.stdin_lines += [str(len(keys))] + [f"{k} {w.rng.randint(1, 50)}" for k in keys]
    w.stdin_lines.append(w.rng.choice(keys + [w.word()]))
    w.emit(f"""
        {n} = int(input())
        {table} = {{}}
        for _ in range({n}):
            {key}, {val} = input().split()
            {table}[{key}] = int({val})
        {query} = input().strip()
        print({table}.get({query}, -1), sum({table}.values()))
    """)


def subsets(w: _ProgramWriter) -> None:
    f, items, rest = w.name("func"), w.name("seq"), w.name("seq")
    w.emit(f"""
        def {f}({items}):
            if not {items}:
                return [[]]
            {rest} = {f}({items}[1:])
            return {rest} + [[{items}[0]] + r for r in {rest}]
        print({f}({w.ints(w.rng.randint(2, 3), 1, 9)}))
    """)


LEVEL_0: tuple[Snippet, ...] = (print_value, copy_value, one_expression)
LEVEL_1: tuple[Snippet, ...] = (
    arithmetic, sum_loop, string_build, list_ops, collatz, fibonacci_pairs, branch, string_methods,
    char_counts, comprehension, min_max, times_table,
)
LEVEL_2: tuple[Snippet, ...] = (
    function_with_default, gcd_function, primes, matrix, sort_words, bracket_check, to_binary, zip_enumerate,
    stdin_numbers, while_break, grouping, bubble_sort, binary_search, run_length, formatted_table,
    conditional_assignment,
)
LEVEL_3: tuple[Snippet, ...] = (
    recursion, memo_fibonacci, class_counter, inheritance, handled_exceptions, parse_tokens, custom_exception,
    key_lookup, generator, closure, stdin_table, subsets,
)


def generate_program(task_id: int) -> TraceProgram:
    """The embedded program of `task_id`: same id, same program and stdin, on every machine."""
    level = trace_level_of(task_id)
    rng = random.Random(task_id)
    writer = _ProgramWriter(rng, level)
    if level == 0:
        snippets = [rng.choice(LEVEL_0)]
    elif level == 1:
        snippets = rng.sample(LEVEL_1, rng.randint(1, 2))
    elif level == 2:
        snippets = rng.sample(LEVEL_2, rng.randint(1, 2)) + rng.sample(LEVEL_1, 1)
    else:
        snippets = rng.sample(LEVEL_3, rng.randint(2, 3)) + rng.sample(LEVEL_1 + LEVEL_2, 1)
    rng.shuffle(snippets)
    for snippet in snippets:
        snippet(writer)
    lines = writer.lines
    if level > 1 and rng.random() < 0.2 * level:
        # Running inside main() changes which names are live where the debug prints go.
        guard = rng.random() < 0.5
        lines = ["def main():"] + ["    " + line for line in lines]
        lines += ["if __name__ == '__main__':", "    main()"] if guard else ["main()"]
    inputs = "".join(line + "\n" for line in writer.stdin_lines)
    return TraceProgram(source="\n".join(lines) + "\n", inputs=inputs, difficulty=level)


@functools.lru_cache(maxsize=None)
def _held_out_sources(level: int) -> frozenset[str]:
    """The program texts of `level`'s held-out tasks (0.3 s for level 0's 10 000, 1.5 s for level 3's)."""
    low = trace_level_range(level)[0]
    return frozenset(generate_program(task_id).source for task_id in range(low, low + TRACE_HELD_OUT))


def repeats_a_held_out_program(task_id: int) -> bool:
    """Whether a training task's program is, character for character, the program of a held-out task of its level
    under another id. Level 0's one-snippet programs repeat often: 929 of its first 3 000 training ids do, so
    separating held-out tasks by id alone trained on 12 of the 48 the trace bench judges on."""
    return not is_held_out_trace_task(task_id) and (
        generate_program(task_id).source in _held_out_sources(trace_level_of(task_id)))
