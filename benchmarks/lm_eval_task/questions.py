"""The multiple-choice questions of the ``pdserve_mc`` lm-eval task, made deterministically:
capitals, sums, opposites, sequences, plurals, colours and young animals, each with its right
answer among distractors of the same kind, the answer's place drawn by a fixed seed. Easy enough
that SmolLM2-135M gets part of them right, so the accuracy says something.

    python benchmarks/lm_eval_task/questions.py     # rewrites questions.jsonl beside this file

lm-eval puts a space between ``question`` and a choice (its ``target_delimiter``), so the
choices carry no leading space.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 35
DATA_FILE = Path(__file__).with_name("questions.jsonl")
NUM_CHOICES = 4

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo",
    "England": "London", "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna",
    "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw",
    "Canada": "Ottawa", "Australia": "Canberra", "India": "New Delhi", "Kenya": "Nairobi",
    "Peru": "Lima", "Argentina": "Buenos Aires", "Thailand": "Bangkok", "Turkey": "Ankara",
    "Mexico": "Mexico City",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "day": "night",
    "happy": "sad", "light": "dark", "open": "closed", "old": "young", "rich": "poor",
    "early": "late", "full": "empty", "hard": "soft", "wet": "dry", "loud": "quiet",
    "strong": "weak", "tall": "short", "thick": "thin", "win": "lose", "in": "out",
    "left": "right", "push": "pull", "first": "last", "high": "low", "buy": "sell",
}  # fmt: skip
PLURALS = {
    "mouse": "mice", "child": "children", "foot": "feet", "tooth": "teeth", "man": "men",
    "woman": "women", "goose": "geese", "box": "boxes", "city": "cities", "knife": "knives",
    "leaf": "leaves", "baby": "babies", "bus": "buses", "person": "people", "ox": "oxen",
}  # fmt: skip
COLOURS = {
    "grass": "green", "snow": "white", "a ripe banana": "yellow", "the clear sky": "blue",
    "coal": "black", "blood": "red", "an orange": "orange", "a ripe tomato": "red",
    "milk": "white", "a lemon": "yellow", "the sea": "blue", "chocolate": "brown",
    "a crow": "black", "a carrot": "orange", "a plum": "purple",
}  # fmt: skip
YOUNG = {
    "dog": "puppy", "cat": "kitten", "cow": "calf", "horse": "foal", "sheep": "lamb",
    "goat": "kid", "duck": "duckling", "frog": "tadpole", "bear": "cub", "hen": "chick",
    "kangaroo": "joey", "deer": "fawn", "goose": "gosling", "pig": "piglet", "swan": "cygnet",
}  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]  # fmt: skip


def question(rng: random.Random, text: str, answer: str, pool: list[str]) -> dict[str, object]:
    """One question: ``answer`` among NUM_CHOICES - 1 others drawn from ``pool``."""
    others = sorted({p for p in pool if p != answer})
    choices = rng.sample(others, NUM_CHOICES - 1)
    position = rng.randrange(NUM_CHOICES)
    choices.insert(position, answer)
    return {"question": f"Question: {text}\nAnswer:", "choices": choices, "answer": position}


def from_table(rng: random.Random, table: dict[str, str], template: str) -> list[dict[str, object]]:
    pool = list(table.values())
    return [question(rng, template.format(key), value, pool) for key, value in table.items()]


def sums(rng: random.Random, count: int) -> list[dict[str, object]]:
    made = []
    for _ in range(count):
        a, b = rng.randrange(1, 20), rng.randrange(1, 20)
        near = [str(a + b + d) for d in (-3, -2, -1, 1, 2, 3) if a + b + d >= 0]
        made.append(question(rng, f"What is {a} plus {b}?", str(a + b), near))
    return made


def sequences(rng: random.Random) -> list[dict[str, object]]:
    made = []
    for names in (DAYS, MONTHS):
        for start in range(len(names)):
            shown = [names[(start + i) % len(names)] for i in range(3)]
            answer = names[(start + 3) % len(names)]
            made.append(question(rng, f"What comes after {', '.join(shown)}?", answer, names))
    for step in (2, 3, 5, 10):
        for start in range(1, 5):
            shown = [str(start + step * i) for i in range(4)]
            answer = str(start + step * 4)
            pool = [str(start + step * 4 + d) for d in (-step, -1, 1, step, 2 * step)]
            made.append(question(rng, f"What number comes next: {', '.join(shown)}?", answer, pool))
    return made


TABLES = [
    (CAPITALS, "What is the capital of {}?"),
    (OPPOSITES, "What is the opposite of {}?"),
    (PLURALS, "What is the plural of {}?"),
    (COLOURS, "What colour is {}?"),
    (YOUNG, "What is a young {} called?"),
]


def make_questions() -> list[dict[str, object]]:
    rng = random.Random(SEED)  # drawn from in this order: the order of the file
    capitals, opposites, *others = TABLES
    made = [*from_table(rng, *capitals), *sums(rng, 25), *from_table(rng, *opposites)]
    made += sequences(rng)
    for table, text in others:
        made += from_table(rng, table, text)
    return made


def to_jsonl(questions: list[dict[str, object]]) -> str:
    return "".join(json.dumps(q) + "\n" for q in questions)


if __name__ == "__main__":
    DATA_FILE.write_text(to_jsonl(make_questions()))
    print(f"wrote {len(make_questions())} questions to {DATA_FILE}")
