"""The calculator environment: the model may write `<calc>EXPR</calc>`; the environment appends
`=RESULT` (or `=error`) and the model goes on. A turn that does not end in a call is the final
answer, scored by exact match of its first line. A turn that opens a call and never closes it
ends the episode with reward 0 (reason "unclosed_call")."""
from __future__ import annotations

from hexrl.rewards.synthetic import exact_match_reward

from .arith import ArithError, evaluate, format_number
from .base import Environment, Problem, Step

OPEN, CLOSE = "<calc>", "</calc>"


class Calculator(Environment):
    stop_strings = (CLOSE,)

    def step(self, problem: Problem, turns: list[str]) -> Step:
        turn = turns[-1]
        if turn.endswith(CLOSE):
            start = turn.rfind(OPEN)
            if start < 0:
                return Step(done=True, reason="unopened_call")
            try:
                result = format_number(evaluate(turn[start + len(OPEN):-len(CLOSE)]))
            except ArithError:
                result = "error"
            return Step(observation=f"={result}")
        if turn.rfind(OPEN) > turn.rfind(CLOSE):
            return Step(done=True, reason="unclosed_call")
        return Step(done=True, reward=exact_match_reward(turn, problem.answer or ""), reason="answer")
