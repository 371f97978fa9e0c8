"""Build the bundled country relations from data packages (not from memory).

Run from the repository root (needs the ``data`` extra: ``pip install pycountry countryinfo``)::

    python prompts/build_countries.py            # writes prompts/country_*.json
    python prompts/build_countries.py --check    # exit 1 if the committed files differ

Sources: ``pycountry`` (ISO 3166-1 codes and names, ISO 639 language names, ISO 4217 currency names) and
``countryinfo`` (capital, UN M49 region/subregion, languages, currencies, demonym, population).

Subjects are the 193 UN member states: the ISO 3166-1 entries minus the dependent territories, disputed
and observer entities listed in ``NON_MEMBERS`` (the script asserts that exactly 193 remain). Facts are
sorted by population (countryinfo's figure, most populous first), so ``facts[:n]`` are the n most populous.
Every hand correction to the package data is listed below with its reason.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import pycountry
from countryinfo import CountryInfo

from llmprobe.datasets import format_json

OUT_DIR = Path(__file__).resolve().parent

# ISO 3166-1 entries that are not UN member states (territories, dependencies, Antarctica, observers, Taiwan).
NON_MEMBERS = set(
    "AS AI AQ AW AX BL BM BQ BV CC CK CW CX EH FK FO GF GG GI GL GP GS GU HK HM IM IO JE KY MF MO MP MQ "
    "MS NC NF NU PF PM PN PR PS RE SH SJ SX TC TF TK TW UM VA VG VI WF YT".split()
)

# Names: pycountry's common_name where it has one, else countryinfo's short English name,
# except these official renames that countryinfo predates.
RENAMED = {"SZ": "Eswatini", "MK": "North Macedonia"}

# Corrections to countryinfo values (each with its reason).
CAPITAL_FIX = {
    "US": "Washington, D.C.",  # countryinfo spells it "Washington D.C."
    "KZ": "Astana",   # countryinfo has "Nur-Sultan"; the city was renamed back to Astana in 2022
    "SZ": "Mbabane",  # countryinfo has Lobamba (royal/legislative); Mbabane is the executive capital
}
LANGUAGE_CODE_FIX = {"rs": "sr"}  # countryinfo uses "rs" (a country code) for Serbian
PRIMARY_LANGUAGE_FIX = {
    "MY": "ms",  # countryinfo lists no language for Malaysia; Malay is the national language
    "PK": "ur",  # countryinfo lists English first; Urdu is the national language
    "ZA": "en",  # countryinfo lists 11 official languages, Afrikaans first; English is the common one
}
# Outdated ISO 4217 codes in countryinfo -> current code (pycountry only knows current ones).
CURRENCY_CODE_FIX = {
    "ZMK": "ZMW", "VEF": "VES", "BYR": "BYN", "STD": "STN", "MRO": "MRU", "SLL": "SLE",
    "HRK": "EUR",  # Croatia adopted the euro in 2023
    "BGN": "EUR",  # Bulgaria adopted the euro in 2026 (pycountry no longer lists the lev)
    "CUC": None,   # Cuban convertible peso, abolished 2021
}
# ISO 4217 fund codes (accounting units, not the everyday currency).
FUND_CODES = {"BOV", "CHE", "CHW", "CLF", "COU", "MXV", "USN", "USS", "UYI", "UYW", "XSU", "XUA"}
# Currency names as people write them (pycountry uses the ISO 4217 list names).
CURRENCY_NAME_FIX = {
    "CNY": "Renminbi",
    "XOF": "West African CFA franc",
    "XAF": "Central African CFA franc",
    "ILS": "Israeli new shekel",
    "VES": "Venezuelan bolívar",
    "UYU": "Uruguayan Peso",
    "OMR": "Omani Rial",
    "NIO": "Nicaraguan Córdoba",
    "TOP": "Pa'anga",
    "UZS": "Uzbekistani Som",
    "TMT": "Turkmen Manat",
}
# Everyday currency where countryinfo lists a legal-tender currency first that is no longer in use.
PRIMARY_CURRENCY_FIX = {"SV": "USD"}  # El Salvador: US dollar since 2001, the colón no longer circulates
LANGUAGE_NAME_FIX = {
    "Modern Greek": "Greek", "Pushto": "Pashto", "Kirghiz": "Kyrgyz", "Divehi": "Dhivehi",
    "Haitian": "Haitian Creole", "Rundi": "Kirundi", "Tonga": "Tongan", "Nauru": "Nauruan",
}
# Misspelt or noun-only demonyms in countryinfo -> the usual English adjective.
DEMONYM_FIX = {
    "Argentinean": "Argentine", "Tadzhik": "Tajik", "Kirghiz": "Kyrgyz", "Djibouti": "Djiboutian",
    "Maldivan": "Maldivian", "Cape Verdian": "Cape Verdean", "Surinamer": "Surinamese", "Comoran": "Comorian",
    "Icelander": "Icelandic",
}

COUNTRY_NEUTRAL = ["{}", "{} is a country.", "Tell me about {}.", "Here is some information about {}:"]

RELATIONS = {
    "country_capital": dict(
        templates=["The capital of {} is", "{}'s capital city is", "The capital city of {} is called",
                   "Q: What is the capital of {}?\nA:"],
        object_type="city"),
    "country_continent": dict(
        templates=["{} is a country on the continent of", "{} is located in the continent of",
                   "The continent where {} lies is", "Q: On which continent is {}?\nA:"],
        object_type="continent"),
    "country_subregion": dict(
        templates=["{} is a country in the region of", "Geographically, {} is part of the region of",
                   "In the UN geoscheme, {} belongs to the subregion of"],
        object_type="region"),
    "country_language": dict(
        templates=["The official language of {} is", "In {}, most people speak", "The national language of {} is",
                   "Q: What language is spoken in {}?\nA:"],
        object_type="language"),
    "country_currency": dict(
        templates=["The currency of {} is the", "In {}, people pay with the", "The official currency of {} is the",
                   "Q: What is the currency of {}?\nA:"],
        object_type="currency"),
    "country_demonym": dict(
        templates=["The nationality of people from {} is", "A citizen of {} has the nationality",
                   "People from {} are described with the adjective"],
        object_type="demonym"),
}


def _clean(s):
    return re.sub(r"\s*\(.*\)$", "", s.strip()) if s else s


def language_name(code):
    code = LANGUAGE_CODE_FIX.get(code, code)
    lang = pycountry.languages.get(alpha_2=code) or pycountry.languages.get(alpha_3=code)
    if lang is None:
        raise ValueError(f"unknown language code {code!r}")
    name = _clean(lang.name)
    return LANGUAGE_NAME_FIX.get(name, name)


def currency_codes(codes):
    out = []
    for c in codes or []:
        c = CURRENCY_CODE_FIX.get(c, c)
        if c and c not in FUND_CODES and c not in out:
            out.append(c)
    return out


def currency_name(code):
    cur = pycountry.currencies.get(alpha_3=code)
    if cur is None:
        raise ValueError(f"unknown currency code {code!r}")
    return CURRENCY_NAME_FIX.get(code, cur.name)


def continent(info):
    region, inter = info.get("region"), info.get("intermediateregion") or ""
    if region == "Americas":
        return "South America" if inter == "South America" else "North America"
    return region


def subregion(info):
    return info.get("intermediateregion") or info.get("subregion")


def collect():
    """One record per UN member state, most populous first."""
    rows = []
    for c in pycountry.countries:
        if c.alpha_2 in NON_MEMBERS:
            continue
        info = CountryInfo(c.alpha_2).info()
        if info.get("ISO", {}).get("alpha2") != c.alpha_2:
            raise ValueError(f"countryinfo returned {info.get('name')!r} for {c.alpha_2}")
        name = RENAMED.get(c.alpha_2) or getattr(c, "common_name", None) or info["name"]
        name = re.sub(r"^The ", "", name)
        langs = [LANGUAGE_CODE_FIX.get(x, x) for x in info.get("languages") or []]
        primary = PRIMARY_LANGUAGE_FIX.get(c.alpha_2) or (langs[0] if langs else None)
        curs = currency_codes(info.get("currencies"))
        if c.alpha_2 in PRIMARY_CURRENCY_FIX:
            first = PRIMARY_CURRENCY_FIX[c.alpha_2]
            curs = [first] + [x for x in curs if x != first]
        demonym = (info.get("demonym") or "").split(",")[0].split("/")[0].strip()
        rows.append(dict(
            code=c.alpha_2, name=name, population=int(info.get("population") or 0),
            country_capital=[CAPITAL_FIX.get(c.alpha_2) or info.get("capital")],
            country_continent=[continent(info)],
            country_subregion=[subregion(info)],
            country_language=[language_name(x) for x in ([primary] + [x for x in langs if x != primary])
                              if x] if primary else [],
            country_currency=[currency_name(x) for x in curs],
            country_demonym=[DEMONYM_FIX.get(demonym, demonym)],
        ))
    if len(rows) != 193:
        raise SystemExit(f"expected 193 UN member states, got {len(rows)}")
    rows.sort(key=lambda r: (-r["population"], r["name"]))
    return rows


def build(rows):
    src = f"pycountry {version('pycountry')} + countryinfo {version('countryinfo')} (prompts/build_countries.py)"
    licence = (f"Apache-2.0 (llmprobe); drawn from the data of pycountry {version('pycountry')} (LGPL-2.1-only) and "
               f"countryinfo {version('countryinfo')} (MIT)")
    out = {}
    for rel, spec in RELATIONS.items():
        facts, others = [], {}
        for r in rows:
            vals = [v for v in r[rel] if isinstance(v, str) and v.strip()]
            if not vals:
                continue
            facts.append({"subject": r["name"], "object": vals[0]})
            if len(vals) > 1:
                others[r["name"]] = vals[1:]
        objs = [f["object"] for f in facts]
        props = {
            "cardinality": "one-to-one" if len(set(objs)) == len(objs) else "many-to-one",
            "subject_type": "country",
            "object_type": spec["object_type"],
            "source": src,
            "licence": licence,
            "order": "population, most populous first (countryinfo figures)",
            "population": {r["name"]: r["population"] for r in rows if r["name"] in {f["subject"] for f in facts}},
        }
        if others:
            props["other_objects"] = others  # further valid answers (other official languages, currencies)
        out[rel] = {
            "name": rel,
            "templates": spec["templates"],
            "neutral_templates": COUNTRY_NEUTRAL,
            "properties": props,
            "facts": facts,
        }
    return out


dump = format_json  # the layout llmprobe.datasets.save_relation writes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT_DIR))
    ap.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    args = ap.parse_args(argv)
    rels = build(collect())
    stale = []
    for name, obj in rels.items():
        path = Path(args.out) / f"{name}.json"
        text = dump(obj)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        print(f"{path}: {len(obj['facts'])} facts, {obj['properties']['cardinality']}")
    if stale:
        print("out of date:", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
