"""Write the project's own multiple-choice set: facts and arithmetic it can verify itself.

    python scripts/make_mc_set.py [-o examples/mc/facts_arith.jsonl] [--seed 0]

Every question is generated from a rule (arithmetic, comparisons, unit factors, the
calendar, the alphabet) or from a small fixed table written below (capital cities,
chemical symbols); nothing is downloaded. The output is deterministic for a seed: one
JSON object per line, {"question", "choices" (4 strings), "answer" (index), "subject"}.
The shipped file is this script's output with the default seed (a test checks that).
"""

from __future__ import annotations

import argparse
import calendar
import json
import random
import string
from collections.abc import Callable
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "examples" / "mc" / "facts_arith.jsonl"

CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("the United Kingdom", "London"),
    ("Ireland", "Dublin"),
    ("the Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"),
    ("Poland", "Warsaw"),
    ("Hungary", "Budapest"),
    ("Greece", "Athens"),
    ("Sweden", "Stockholm"),
    ("Norway", "Oslo"),
    ("Denmark", "Copenhagen"),
    ("Finland", "Helsinki"),
    ("Russia", "Moscow"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("South Korea", "Seoul"),
    ("India", "New Delhi"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"),
    ("the Philippines", "Manila"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Nigeria", "Abuja"),
    ("Ghana", "Accra"),
    ("Morocco", "Rabat"),
    ("Canada", "Ottawa"),
    ("Mexico", "Mexico City"),
    ("Brazil", "Brasilia"),
    ("Argentina", "Buenos Aires"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Colombia", "Bogota"),
    ("Australia", "Canberra"),
    ("New Zealand", "Wellington"),
    ("Turkey", "Ankara"),
    ("Iran", "Tehran"),
    ("Saudi Arabia", "Riyadh"),
    ("Cuba", "Havana"),
]

ELEMENTS = [
    ("hydrogen", "H"),
    ("helium", "He"),
    ("lithium", "Li"),
    ("carbon", "C"),
    ("nitrogen", "N"),
    ("oxygen", "O"),
    ("fluorine", "F"),
    ("neon", "Ne"),
    ("sodium", "Na"),
    ("magnesium", "Mg"),
    ("aluminium", "Al"),
    ("silicon", "Si"),
    ("phosphorus", "P"),
    ("sulfur", "S"),
    ("chlorine", "Cl"),
    ("argon", "Ar"),
    ("potassium", "K"),
    ("calcium", "Ca"),
    ("titanium", "Ti"),
    ("iron", "Fe"),
    ("cobalt", "Co"),
    ("nickel", "Ni"),
    ("copper", "Cu"),
    ("zinc", "Zn"),
    ("silver", "Ag"),
    ("tin", "Sn"),
    ("iodine", "I"),
    ("platinum", "Pt"),
    ("gold", "Au"),
    ("mercury", "Hg"),
    ("lead", "Pb"),
    ("uranium", "U"),
]

# (larger unit, smaller unit, how many smaller units make one larger unit)
UNITS = [
    ("metres", "centimetres", 100),
    ("kilometres", "metres", 1000),
    ("kilograms", "grams", 1000),
    ("litres", "millilitres", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("weeks", "days", 7),
    ("years", "months", 12),
    ("dozens", "items", 12),
]

DAYS = list(calendar.day_name)  # Monday first
MONTHS = list(calendar.month_name)[1:]
ORDINALS = {2: "two", 3: "three", 4: "four"}

Question = dict


def question(subject: str, text: str, correct: str, distractors: list[str], rng) -> Question:
    """Four distinct choices in a random order; `answer` is the correct one's index."""
    choices = [correct, *distractors[:3]]
    if len(set(choices)) != 4:
        raise ValueError(f"choices are not four distinct strings: {choices}")
    rng.shuffle(choices)
    return {
        "question": text,
        "choices": choices,
        "answer": choices.index(correct),
        "subject": subject,
    }


def numeric_distractors(correct: int, near: list[int], rng) -> list[str]:
    """Three distinct wrong non-negative numbers, preferring the `near` mistakes."""
    pool = [n for n in dict.fromkeys(near) if n != correct and n >= 0]
    rng.shuffle(pool)
    extra = [correct + d for d in (1, -1, 2, -2, 10, -10, 3, -3, 11, -11)]
    for n in extra:
        if n >= 0 and n != correct and n not in pool:
            pool.append(n)
    return [str(n) for n in pool[:3]]


def addition(rng) -> Question:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    c = a + b
    wrong = [c + 10, c - 10, c + 1, c - 1, abs(a - b)]
    return question(
        "arithmetic", f"What is {a} + {b}?", str(c), numeric_distractors(c, wrong, rng), rng
    )


def subtraction(rng) -> Question:
    a = rng.randint(10, 99)
    b = rng.randint(1, a)
    c = a - b
    wrong = [c + 10, c - 10, c + 1, c - 1, a + b]
    return question(
        "arithmetic", f"What is {a} - {b}?", str(c), numeric_distractors(c, wrong, rng), rng
    )


def multiplication(rng) -> Question:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    c = a * b
    wrong = [c + a, c - a, c + b, c - b, a + b]
    return question(
        "arithmetic", f"What is {a} x {b}?", str(c), numeric_distractors(c, wrong, rng), rng
    )


def comparison(rng) -> Question:
    numbers = rng.sample(range(1, 1000), 4)
    largest = rng.random() < 0.5
    word = "largest" if largest else "smallest"
    correct = max(numbers) if largest else min(numbers)
    others = [str(n) for n in numbers if n != correct]
    return question(
        "comparison", f"Which of these numbers is the {word}?", str(correct), others, rng
    )


def parity(rng) -> Question:
    want_even = rng.random() < 0.5
    numbers = rng.sample(range(1, 200), 40)
    matching = [n for n in numbers if (n % 2 == 0) == want_even]
    other = [n for n in numbers if (n % 2 == 0) != want_even]
    word = "even" if want_even else "odd"
    return question(
        "parity",
        f"Which of these numbers is {word}?",
        str(matching[0]),
        [str(n) for n in other[:3]],
        rng,
    )


def unit_conversion(rng) -> Question:
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 9)
    c = n * factor
    wrong = [c * 10, c // 10 if c >= 10 else c + factor, (n + 1) * factor, (n - 1) * factor]
    if factor == 1000:
        wrong.append(n * 100)
    return question(
        "units",
        f"How many {small} are in {n} {big}?",
        str(c),
        numeric_distractors(c, wrong, rng),
        rng,
    )


def day_after(rng) -> Question:
    i = rng.randrange(7)
    k = rng.choice([1, 1, 2, 3])
    day = DAYS[(i + k) % 7]
    text = (
        f"Which day of the week comes right after {DAYS[i]}?"
        if k == 1
        else f"Which day of the week is {ORDINALS[k]} days after {DAYS[i]}?"
    )
    others = [d for d in DAYS if d not in (day, DAYS[i])]
    rng.shuffle(others)
    return question("calendar", text, day, others, rng)


def month_after(rng) -> Question:
    i = rng.randrange(12)
    before = rng.random() < 0.5
    month = MONTHS[(i - 1) % 12] if before else MONTHS[(i + 1) % 12]
    word = "before" if before else "after"
    others = [m for m in MONTHS if m not in (month, MONTHS[i])]
    rng.shuffle(others)
    return question("calendar", f"Which month comes right {word} {MONTHS[i]}?", month, others, rng)


def days_in_month(rng) -> Question:
    m = rng.randrange(1, 13)
    days = calendar.monthrange(2023, m)[1]  # 2023 is not a leap year
    others = [str(d) for d in (28, 29, 30, 31) if d != days]
    return question(
        "calendar",
        f"How many days are in {MONTHS[m - 1]} in a year that is not a leap year?",
        str(days),
        others,
        rng,
    )


def letter_after(rng) -> Question:
    letters = string.ascii_uppercase
    i = rng.randrange(1, 25)
    kind = rng.choice(["after", "before", "position"])
    if kind == "position":
        text = f"Which letter is number {i + 1} in the English alphabet?"
        correct = letters[i]
    else:
        correct = letters[i + 1] if kind == "after" else letters[i - 1]
        text = f"Which letter comes right {kind} {letters[i]} in the English alphabet?"
    near = [letters[j] for j in (i - 2, i - 1, i, i + 1, i + 2) if 0 <= j < 26]
    others = [x for x in dict.fromkeys(near) if x != correct]
    rng.shuffle(others)
    return question("alphabet", text, correct, others, rng)


def capital(rng, country: str, city: str) -> Question:
    others = [c for _, c in CAPITALS if c != city]
    return question(
        "capitals", f"What is the capital of {country}?", city, rng.sample(others, 3), rng
    )


def chemical_symbol(rng, name: str, symbol: str) -> Question:
    symbols = [s for _, s in ELEMENTS]
    lookalike = name[:2].title()
    pool = [lookalike] if lookalike != symbol and lookalike not in symbols else []
    pool += rng.sample([s for s in symbols if s != symbol], 3)
    return question("chemistry", f"What is the chemical symbol for {name}?", symbol, pool[:3], rng)


# (generator, how many questions); generators producing a duplicate question are re-drawn.
RULES: list[tuple[Callable, int]] = [
    (addition, 40),
    (subtraction, 35),
    (multiplication, 35),
    (comparison, 25),
    (parity, 25),
    (unit_conversion, 30),
    (day_after, 14),
    (month_after, 12),
    (days_in_month, 12),
    (letter_after, 30),
]


def generate(seed: int = 0) -> list[Question]:
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()  # (question, correct choice): a repeat is re-drawn
    out: list[Question] = []

    def keep(q: Question) -> bool:
        key = (q["question"], q["choices"][q["answer"]])
        if key in seen:
            return False
        seen.add(key)
        out.append(q)
        return True

    for rule, count in RULES:
        made = 0
        for _ in range(count * 50):
            made += keep(rule(rng))
            if made == count:
                break
        if made < count:
            raise RuntimeError(f"{rule.__name__}: only {made} distinct questions of {count}")
    for country, city in CAPITALS:
        keep(capital(rng, country, city))
    for name, symbol in ELEMENTS:
        keep(chemical_symbol(rng, name, symbol))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    questions = generate(args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        for q in questions:
            f.write(json.dumps(q, ensure_ascii=False) + "\n")
    print(f"wrote {len(questions)} questions to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
