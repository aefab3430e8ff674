"""The built-in STEM set: science questions generated here by code, so ``builtin:stem`` works offline and
every ground truth is exact (computed, or taken from the small fact tables below).

Covers each answer type the handler grades: numeric answers with units (kinematics, circuits, gases,
molar masses, half-lives), multiple choice (element families, SI units, organelles), short text
(chemical symbols, case-sensitive) and expressions (derivatives, checked with math-verify).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from raas.errors import RaasError

BUILTIN_STEM_DEFAULT_N = 16
BUILTIN_STEM_MAX_N = 500
_SEED = 20240917

_ATOMIC_MASS = {
    "H": 1.008,
    "C": 12.011,
    "N": 14.007,
    "O": 15.999,
    "Na": 22.990,
    "Cl": 35.45,
    "S": 32.06,
    "Ca": 40.078,
}
_COMPOUNDS = {
    "water (H2O)": {"H": 2, "O": 1},
    "carbon dioxide (CO2)": {"C": 1, "O": 2},
    "sodium chloride (NaCl)": {"Na": 1, "Cl": 1},
    "glucose (C6H12O6)": {"C": 6, "H": 12, "O": 6},
    "ammonia (NH3)": {"N": 1, "H": 3},
    "methane (CH4)": {"C": 1, "H": 4},
    "sulfuric acid (H2SO4)": {"H": 2, "S": 1, "O": 4},
    "calcium carbonate (CaCO3)": {"Ca": 1, "C": 1, "O": 3},
    "ethanol (C2H5OH)": {"C": 2, "H": 6, "O": 1},
}
_SYMBOLS = {
    "sodium": "Na",
    "potassium": "K",
    "iron": "Fe",
    "copper": "Cu",
    "silver": "Ag",
    "gold": "Au",
    "lead": "Pb",
    "tin": "Sn",
    "mercury": "Hg",
    "tungsten": "W",
    "cobalt": "Co",
    "chlorine": "Cl",
}
_FAMILIES = {
    "a noble gas": ["helium", "neon", "argon", "krypton", "xenon"],
    "an alkali metal": ["lithium", "sodium", "potassium", "rubidium", "cesium"],
    "a halogen": ["fluorine", "chlorine", "bromine", "iodine"],
}
_SI_UNITS = {
    "force": "newton",
    "energy": "joule",
    "power": "watt",
    "electric charge": "coulomb",
    "pressure": "pascal",
    "frequency": "hertz",
    "electric resistance": "ohm",
    "magnetic flux density": "tesla",
}
_ORGANELLES = {
    "produces most of the cell's ATP through cellular respiration": "mitochondrion",
    "carries out photosynthesis in plant cells": "chloroplast",
    "synthesizes proteins by translating messenger RNA": "ribosome",
    "modifies, sorts and packages proteins for secretion": "Golgi apparatus",
    "contains digestive enzymes that break down waste": "lysosome",
    "stores the cell's genetic material in eukaryotes": "nucleus",
}
_LETTERS = "ABCD"


def _numeric(question: str, value: float, unit: str, digits: int = 4) -> dict[str, Any]:
    return {"question": question, "answer": f"{value:.{digits}g} {unit}".strip(), "answer_type": "numeric"}


def _kinematics(r: random.Random) -> dict[str, Any]:
    a, t = r.randint(2, 9), r.randint(3, 12)
    return _numeric(
        f"A cart starts from rest and accelerates uniformly at {a} m/s^2 for {t} s. How far does it travel, "
        "in meters?",
        0.5 * a * t * t,
        "m",
    )


def _ohm(r: random.Random) -> dict[str, Any]:
    v, ohms = r.choice([3, 5, 9, 12, 24, 120]), r.choice([2, 4, 8, 10, 16, 20, 40])
    return _numeric(
        f"A resistor of {ohms} ohms is connected across an ideal {v} V battery. What current flows through it, "
        "in amperes?",
        v / ohms,
        "A",
    )


def _ideal_gas(r: random.Random) -> dict[str, Any]:
    n, temp, litres = r.choice([0.5, 1, 2, 3]), r.choice([273, 300, 350, 400]), r.choice([10, 20, 25, 50])
    kpa = n * 8.314 * temp / (litres / 1000) / 1000
    return _numeric(
        f"{n} mol of an ideal gas occupies {litres} L at {temp} K. What is its pressure in kilopascals? "
        "Use R = 8.314 J/(mol K).",
        kpa,
        "kPa",
    )


def _molar_mass(r: random.Random) -> dict[str, Any]:
    name = r.choice(sorted(_COMPOUNDS))
    mass = sum(_ATOMIC_MASS[el] * k for el, k in _COMPOUNDS[name].items())
    table = ", ".join(f"{el} = {m}" for el, m in _ATOMIC_MASS.items() if el in _COMPOUNDS[name])
    return _numeric(
        f"Using the atomic masses {table} (g/mol), what is the molar mass of {name} in g/mol?", mass, "g/mol"
    )


def _half_life(r: random.Random) -> dict[str, Any]:
    half, n, grams = r.choice([5, 8, 12, 30]), r.randint(2, 5), r.choice([64, 80, 100, 160, 200])
    return _numeric(
        f"A radioactive isotope has a half-life of {half} days. How many grams of a {grams} g sample remain "
        f"after {half * n} days?",
        grams / 2**n,
        "g",
    )


def _choice(question: str, right: str, wrong: list[str], r: random.Random) -> dict[str, Any]:
    options = [right, *r.sample(wrong, 3)]
    r.shuffle(options)
    return {"question": question, "choices": options, "answer": _LETTERS[options.index(right)]}


def _family(r: random.Random) -> dict[str, Any]:
    family = r.choice(sorted(_FAMILIES))
    right = r.choice(_FAMILIES[family])
    wrong = [el for other, els in _FAMILIES.items() if other != family for el in els]
    return _choice(f"Which of the following elements is {family}?", right, wrong, r)


def _si_unit(r: random.Random) -> dict[str, Any]:
    quantity = r.choice(sorted(_SI_UNITS))
    wrong = [u for q, u in _SI_UNITS.items() if q != quantity]
    return _choice(f"What is the SI unit of {quantity}?", _SI_UNITS[quantity], wrong, r)


def _organelle(r: random.Random) -> dict[str, Any]:
    role = r.choice(sorted(_ORGANELLES))
    wrong = [o for k, o in _ORGANELLES.items() if k != role]
    return _choice(f"Which organelle {role}?", _ORGANELLES[role], wrong, r)


def _symbol(r: random.Random) -> dict[str, Any]:
    element = r.choice(sorted(_SYMBOLS))
    return {
        "question": f"What is the chemical symbol of {element}? Mind the capitalization.",
        "answer": _SYMBOLS[element],
        "answer_type": "text",
        "case_sensitive": True,
    }


def _derivative(r: random.Random) -> dict[str, Any]:
    a, b, c = r.randint(2, 9), r.randint(1, 9), r.randint(1, 20)
    return {
        "question": f"What is the derivative of f(x) = {a}x^3 + {b}x^2 + {c} with respect to x?",
        "answer": f"{3 * a}x^2 + {2 * b}x",
        "answer_type": "expression",
    }


_TEMPLATES: list[Callable[[random.Random], dict[str, Any]]] = [
    _kinematics,
    _family,
    _ohm,
    _symbol,
    _ideal_gas,
    _si_unit,
    _molar_mass,
    _derivative,
    _half_life,
    _organelle,
]


def builtin_stem(n: int = BUILTIN_STEM_DEFAULT_N) -> list[dict[str, Any]]:
    """``n`` deterministic science questions (the same ``n`` gives the same list, prefix-stable)."""
    if not 1 <= n <= BUILTIN_STEM_MAX_N:
        raise RaasError(f"builtin:stem size must be in 1..{BUILTIN_STEM_MAX_N}, got {n}", kind="bad_request")
    out = []
    for i in range(n):
        r = random.Random(_SEED * 1000 + i)
        record = _TEMPLATES[i % len(_TEMPLATES)](r)
        out.append({"instance_id": f"builtin-stem-{i:04d}", "data_source": "stem", **record})
    return out
