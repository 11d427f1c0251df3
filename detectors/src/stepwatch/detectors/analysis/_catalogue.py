"""The docs' tables of kinds and signatures, made from the rules' declarations.

docs/schema.md lists the kinds and docs/diagnosis.md the classification; both tables are
these functions' output, and a test checks that the files hold them, so a kind declared in
one rule module appears in both with no other edit.
"""

from __future__ import annotations

from stepwatch.detectors.analysis._rule import Registry


def kinds_table(registry: Registry) -> str:
    """A Markdown table of every kind and what its data shows."""
    rows = ["| kind | what the data shows | what a finding names |", "|---|---|---|"]
    rows += [f"| `{k.name}` | {k.shows} | {k.localised} |" for k in registry.declared]
    return "\n".join(rows)


def classification_table(registry: Registry) -> str:
    """A Markdown table of every episode signature, by precedence."""
    rows = ["| precedence | flagged metrics | kind |", "|---|---|---|"]
    rows += [
        f"| {signature.precedence} | {signature.shows} | `{rule.kind}` |"
        for signature, rule in registry.precedence
    ]
    return "\n".join(rows)
