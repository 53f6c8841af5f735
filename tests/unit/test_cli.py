"""`python -m kvshot --help`: every stage and every flag says what it is."""
from __future__ import annotations

import argparse

from kvshot.__main__ import STAGES, parser


def test_every_stage_and_flag_has_help():
    p = parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    described = {c.dest: c.help for c in sub._choices_actions}
    assert set(STAGES) <= set(described), set(STAGES) - set(described)
    for stage, sp in sub.choices.items():
        assert described[stage], stage
        for action in sp._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{stage}: {action.option_strings or action.dest} has no help"
