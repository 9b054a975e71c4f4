"""Math answer checking: extract the final answer, compare it exactly, else ask math-verify.

Conventions (documented choices):
- the answer is the LAST well-formed `\\boxed{...}` / `\\fbox{...}`, else the text after the
  last `####` (GSM8K), else the last "the (final) answer is X", else none (reward 0) unless
  `last_number_fallback=True`;
- every answer a completion states with a marker (each `\\boxed{...}`, each `####` line holding a
  number) must be equivalent to the final one, else the reward is 0 (`\\boxed{1} or \\boxed{2}`,
  or `\\boxed{1}` then `#### 2`, is a hedge); one answer repeated still scores;
- one answer that lists alternatives is a hedge too: an answer holding a connective the reference
  does not hold (`\\lor`, `\\vee`, `\\cup`, `\\mid`, `|`, `\\approx`, `\\sim`, any arrow, a line
  break `\\\\`, a word like "or"/"maybe"/"also" in text or math, a bracketed `\\text` aside, an
  unclosed `\\begin`) scores 0: `\\boxed{2 \\lor 3}` earns nothing against 3, `2 \\text{ or } 3`
  scores against the reference `2 \\text{ or } 3`;
- a repeating decimal is exact: `0.\\overline{3}` (or `\\bar`, `\\dot`) equals `\\frac{1}{3}`;
- percent signs are dropped: `50\\%` equals `50` (and does NOT equal `0.5`);
- units (`\\text{cm}`, `^\\circ`, `5 inches`) are dropped after a number;
- `1,000` equals `1000` only when the whole answer is a thousands-grouped number, so the
  tuple `1,2` stays a tuple;
- numbers compare EXACTLY as fractions, with no tolerance: `0.5`, `1/2`, `\\frac12`,
  `\\dfrac{1}{2}` are equal; `1048577` != `1048576`, `0.3333333` != `1/3`, `1e-10` != `0`;
- answers that are not both plain numbers (or equal as normalised strings, or equal tuples)
  go to Hugging Face's math-verify (sympy-based: `\\sqrt{12}` = `2\\sqrt{3}`, `(x+1)^2` =
  `x^2+2x+1`, `2^{10}` = `1024`, `\\{3,2,1\\}` = `\\{1,2,3\\}`), asked both ways round, with
  its own timeouts; when both sides evaluate to numbers its float rounding is overruled by a
  50-digit comparison, so it can never accept a different integer or decimal.
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

_MV_TIMEOUT_S = 3  # math-verify's own parse/verify timeouts (signal based: main thread only)
_MV_DIGITS = 50  # numeric check of math-verify's accepts: far beyond any float rounding
_MAX_NUMBER_LEN = 100  # longer "numbers" are not worth parsing (and could be slow)
_MAX_ANSWER_LEN = 1000  # longer "answers" are compared as plain strings (keeps the worst case cheap)
_MAX_STATED = 8  # more different boxed or `####` answers than this in one completion is a hedge

# ----------------------------------------------------------------------------- extraction


def _matching_brace(s: str, i: int) -> int | None:
    """Index of the brace closing the `{` at s[i], or None if unbalanced."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return None


def _brace_pairs(s: str) -> dict[int, int]:
    """Map each `{` index to its closing `}` index, in one pass (unbalanced ones are absent)."""
    stack, pairs = [], {}
    for i, c in enumerate(s):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def find_all_boxed(text: str) -> list[str]:
    """Contents of every well-formed `\\boxed{...}` or `\\fbox{...}` (nested braces ok), in order.

    `\\boxed 5` (no braces) counts too. Linear time, so a flood of unclosed boxes is cheap.
    """
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)(?![a-zA-Z])", text)]
    if not starts:
        return []
    pairs, out = _brace_pairs(text), []
    for i in starts:
        j = i
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            if j in pairs:
                out.append(text[j + 1:pairs[j]])
        elif j > i and (m := re.match(r"[^\s$]+", text[j:j + 200])):
            out.append(m.group(0))
    return out


def find_boxed(text: str) -> str | None:
    """Content of the last well-formed `\\boxed{...}` or `\\fbox{...}` (see find_all_boxed)."""
    found = find_all_boxed(text)
    return found[-1] if found else None


def hedged(text: str) -> bool:
    """True when the answers the text states with a marker (its boxes, then its `####` lines that
    hold a number: a `#### Step 1` markdown heading states none) are not all the final one (the last
    box, else the last `####`): `\\boxed{1} or \\boxed{2}`, or `\\boxed{1}` then `#### 2`. A model
    that lists candidates must not be rewarded for the one that is right. The same answer repeated,
    or written in equivalent forms, is not a hedge; more than _MAX_STATED different answers always
    is (each needs a comparison)."""
    boxes = [b.strip() for b in find_all_boxed(text)]
    final = boxes[-1] if boxes else find_hash_answer(text)
    if final is None:
        return False
    numbers = [a for a in dict.fromkeys(find_all_hash_answers(text)) if _plain_number(normalize_answer(a))]
    stated = list(dict.fromkeys(boxes + numbers))
    if len(stated) > _MAX_STATED:
        return True
    return any(not answers_match(a, final) for a in stated if a != final)


_CONNECTIVE = re.compile(
    r"\\(lor|land|vee|wedge|lnot|neg|approx\w*|thickapprox|sim|simeq|thicksim|cong|equiv|propto|asymp|doteq|"
    r"mid|nmid|parallel|nparallel|divides|cup|cap|sqcup|sqcap|uplus|setminus|backslash|big(?:cup|cap|vee|wedge|sqcup)|"
    r"to|gets|implies|impliedby|iff|mapsto|longmapsto|leadsto|models|vdash|dashv|therefore|because|lesssim|"
    r"gtrsim|newline|linebreak|cr|par|vert|Vert|\||\\|[a-zA-Z]*(?:arrow|harpoon[a-z]*)s?)(?![a-zA-Z])")
_CONNECTIVE_CHARS = ("|\u2228\u2227\u2248\u223c\u2243\u2245\u2261\u2223\u2225\u222a\u2229"  # | ∨ ∧ ≈ ∼ ≃ ≅ ≡ ∣ ∥ ∪ ∩
                     "\u2192\u2190\u2194\u21d2\u21d0\u21d4\u21a6\u22a2\u22a8\u2234\u2235")  # → ← ↔ ⇒ ⇐ ⇔ ↦ ⊢ ⊨ ∴ ∵
_HEDGE_WORD = re.compile(r"(?<![\\a-zA-Z])(or|either|maybe|possibly|perhaps|alternatively|otherwise|also|else|"
                         r"probably|approximately|approx|roughly|about|around|nearly|almost)(?![a-zA-Z])",
                         re.IGNORECASE)
_TEXT_ASIDE = re.compile(r"\\(?:text\w*|mbox|hbox|math(?:rm|it|sf|tt|bf)|operatorname|emph)\s*\{[^{}]*[(\[][^{}]*\}")


def alternatives(answer: str) -> set[str]:
    """The marks of an answer that lists alternatives or hedges inside one box: connectives
    (logical or, set union, divides, approximately, arrows, line breaks, in LaTeX or Unicode),
    hedge words ("or", "maybe", in text or math), a bracketed `\\text` aside (`2\\text{ (or 3)}`),
    and an environment left open. Empty for a plain answer."""
    marks = {"\\" + m.group(1) for m in _CONNECTIVE.finditer(answer)}
    marks |= {c for c in _CONNECTIVE_CHARS if c in answer}
    marks |= {m.group(1).lower() for m in _HEDGE_WORD.finditer(answer)}
    if any(answer[:m.start()].strip() for m in _TEXT_ASIDE.finditer(answer)):  # `\\text{(B)}` alone is a choice
        marks.add("text aside")
    if answer.count("\\begin") != answer.count("\\end"):
        marks.add("unclosed environment")
    return marks


def lists_alternatives(predicted: str, reference: str) -> bool:
    """A hedge inside one answer: it holds a mark of alternatives (see `alternatives`) that the
    reference, which may itself be such a list, does not."""
    return bool(alternatives(predicted) - alternatives(reference))


def find_all_hash_answers(text: str) -> list[str]:
    """GSM8K style, every one: the rest of each line after its last `####`, where not empty."""
    answers = (line[line.rfind("####") + 4:].strip() for line in text.split("\n") if "####" in line)
    return [a for a in answers if a]


def find_hash_answer(text: str) -> str | None:
    """GSM8K style: the rest of the line after the last `####`."""
    k = text.rfind("####")
    if k < 0:
        return None
    answer = text[k + 4:].split("\n", 1)[0].strip()
    return answer or None


_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


_ANSWER_IS = re.compile(r"answer is:?\s*(.+?)\s*(?:\.(?=\s|$)|$)", re.IGNORECASE | re.MULTILINE)


def find_answer_is(text: str) -> str | None:
    """The last "the answer is X" (X up to the end of its sentence or line, `$` stripped)."""
    found = _ANSWER_IS.findall(text[-5000:])
    answer = found[-1].strip().strip("$").strip() if found else ""
    return answer or None


def extract_answer(text: str, last_number_fallback: bool = False) -> str | None:
    """The final answer: last box, else last `####`, else last "answer is", else (optionally) last number."""
    found = find_boxed(text)
    if found is None:
        found = find_hash_answer(text)
    if found is None:
        found = find_answer_is(text)
    if found is None and last_number_fallback:
        numbers = _LAST_NUMBER.findall(text)
        found = numbers[-1] if numbers else None
    return found


# ----------------------------------------------------------------------------- normalisation

_UNIT_WORDS = (
    "cm|mm|km|m|in|inch|inches|ft|foot|feet|yd|yard|yards|mile|miles|meter|meters|metre|metres|"
    "centimeter|centimeters|kg|g|gram|grams|lb|lbs|pound|pounds|second|seconds|minute|minutes|"
    "hour|hours|day|days|week|weeks|year|years|dollar|dollars|cent|cents|unit|units|degree|"
    "degrees|mph|people|students")
_PLAIN_UNIT = re.compile(
    rf"^([-+]?[\d.,/]+)\s*(?:(?:square|sq|cubic)\.?\s+)?(?:{_UNIT_WORDS})(?:\s*\^\s*\{{?[23]\}}?)?$")
_TEXT_UNIT = re.compile(
    r"\\(?:text|mbox|mathrm|textnormal)\s*\{\s*[a-zA-Z][a-zA-Z .]*\}(?:\s*\^\s*\{?\d\}?)?\s*$")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|textnormal|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[!,;:> ]|\\q?quad(?![a-zA-Z])|~")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![a-zA-Z])|\\circ(?![a-zA-Z])|°")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_ASSIGNMENT = re.compile(r"(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?=(.+)")
_SIMPLE_RATIO = re.compile(r"([A-Za-z0-9.\\{}]+)/([A-Za-z0-9.\\{}]+)")


def _fix_command_args(s: str, command: str, n_args: int) -> str:
    """Brace single-character arguments: `\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`."""
    out, i = [], 0
    while (j := s.find(command, i)) >= 0:
        out.append(s[i:j + len(command)])
        i = j + len(command)
        for _ in range(n_args):
            if i < len(s) and s[i] == "{":
                end = _matching_brace(s, i)
                if end is None:
                    break
                out.append("{" + _fix_command_args(s[i + 1:end], command, n_args) + "}")
                i = end + 1
            elif i < len(s) and s[i] not in "\\[{}":
                out.append("{" + s[i] + "}")
                i += 1
            else:
                break
    out.append(s[i:])
    return "".join(out)


def _strip_units(s: str) -> str:
    m = _TEXT_UNIT.search(s)
    if m and s[:m.start()].strip():
        s = s[:m.start()]
    m = _PLAIN_UNIT.match(s.strip())
    return m.group(1) if m else s


def normalize_answer(s: str) -> str:
    """Canonical string form of an answer (see the module docstring for the rules)."""
    if len(s) > _MAX_ANSWER_LEN:
        return re.sub(r"\s+", "", s)
    s = s.strip().replace("\n", " ").replace("\u2212", "-")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _LEFT_RIGHT.sub("", s)
    s = _DEGREES.sub("", s)
    s = _SPACING.sub(" ", s)
    s = _strip_units(_TEXT_WRAP.sub(r"\1", _strip_units(s)))  # `\text{5 dollars}`: unwrapped, then its unit
    s = re.sub(r"\s+", "", s).rstrip(".")
    if (m := _ASSIGNMENT.fullmatch(s)) and "=" not in m.group(1):
        s = m.group(1)
    s = _fix_command_args(s, "\\frac", 2)
    s = _fix_command_args(s, "\\sqrt", 1)
    if s.startswith("+"):
        s = s[1:]
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if (m := _SIMPLE_RATIO.fullmatch(s)) and _parse_number(s) is None:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    if re.fullmatch(r"\([A-Za-z]\)", s):  # multiple choice "(B)" -> "B"
        s = s[1:-1]
    return s


# ----------------------------------------------------------------------------- comparison

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?"
_FRAC = re.compile(rf"\\frac\{{({_NUM})\}}\{{({_NUM})\}}")
_RATIO = re.compile(rf"({_NUM})/({_NUM})")
_MIXED = re.compile(r"(\d+)\\frac\{(\d+)\}\{(\d+)\}")
_REPEATING = re.compile(r"(\d*)\.(\d*)\\(?:overline|bar|dot)\{(\d+)\}")  # 0.1\overline{6} = 1/6


def _parse_number(s: str) -> Fraction | None:
    """An exact value for a normalised numeric answer: int, decimal, a/b, \\frac{a}{b}, 2\\frac{1}{2}."""
    if not s or len(s) > _MAX_NUMBER_LEN:
        return None
    if s[0] == "-" and len(s) > 1 and s[1] not in "+-":
        v = _parse_number(s[1:])
        return None if v is None else -v
    if re.fullmatch(_NUM, s):
        return Fraction(s)
    for pattern in (_FRAC, _RATIO):
        if m := pattern.fullmatch(s):
            den = Fraction(m.group(2))
            return None if den == 0 else Fraction(m.group(1)) / den
    if m := _MIXED.fullmatch(s):
        den = int(m.group(3))
        return None if den == 0 else int(m.group(1)) + Fraction(int(m.group(2)), den)
    if m := _REPEATING.fullmatch(s):
        whole, fixed, cycle = m.groups()
        head = Fraction(int(whole or "0")) + (Fraction(int(fixed), 10 ** len(fixed)) if fixed else 0)
        return head + Fraction(int(cycle), (10 ** len(cycle) - 1) * 10 ** len(fixed))
    return None


def _split_top_level(s: str) -> list[str]:
    """Split on commas that are not inside any bracket."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _equal_normalized(p: str, g: str) -> bool:
    if p == g:
        return True
    a, b = _parse_number(p), _parse_number(g)
    if a is not None and b is not None:
        return a == b  # exact: no tolerance may accept a different integer
    # tuples / intervals: same brackets, same length, equal elements
    if len(p) > 2 and len(g) > 2 and p[0] == g[0] and p[-1] == g[-1] and p[0] in "([" and p[-1] in ")]":
        ps, gs = _split_top_level(p[1:-1]), _split_top_level(g[1:-1])
        if len(ps) == len(gs) > 1:
            return all(_equal_normalized(normalize_answer(x), normalize_answer(y)) for x, y in zip(ps, gs))
    return False


def _plain_number(s: str) -> bool:
    return _parse_number(s) is not None


def _numbers_differ(a, b) -> bool:
    """True when two sympy values are both numbers and differ at 50 digits."""
    import sympy
    try:
        x, y = sympy.N(a, _MV_DIGITS), sympy.N(b, _MV_DIGITS)
        if not (x.is_number and y.is_number):
            return False
        return bool(abs(x - y) > sympy.Float(10) ** (5 - _MV_DIGITS) * max(1, abs(y)))
    except Exception:
        return True  # a value we cannot evaluate is not a proven equality


def _math_verify_equal(predicted: str, reference: str) -> bool:
    """math-verify's equivalence, asked both ways, with its numeric accepts made exact."""
    from math_verify import parse, verify
    if max(len(predicted), len(reference)) > _MAX_ANSWER_LEN:
        return False
    # Its timeouts use SIGALRM, which only the main thread may set (a reward-pool worker's is);
    # in another thread the caller's own timeout (the pool kills the process) is the bound.
    t = _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    logging.getLogger("math_verify").setLevel(logging.ERROR if t is None else logging.WARNING)  # "timeout disabled"
    gold, pred = (parse(f"${s}$", parsing_timeout=t) for s in (reference, predicted))
    if not gold or not pred:
        return False
    if not (verify(gold, pred, timeout_seconds=t) and verify(pred, gold, timeout_seconds=t)):
        return False
    return not _numbers_differ(pred[0], gold[0])


def answers_match(predicted: str, reference: str) -> bool:
    """True when two final answers are equal: exactly as numbers or strings, else by math-verify."""
    p, g = normalize_answer(predicted), normalize_answer(reference)
    if not p or not g:
        return False
    if _equal_normalized(p, g):
        return True
    if _plain_number(p) and _plain_number(g):
        return False  # two exact numbers were compared exactly above: no second opinion
    try:
        return _math_verify_equal(predicted, reference)
    except Exception:  # a grader error is not a match
        return False


def reference_answer(answer: str) -> str:
    """The reference itself may be a boxed solution or a GSM8K `#### x` line."""
    return find_boxed(answer) or find_hash_answer(answer) or answer


def math_reward(completion: str, answer: str, *, last_number_fallback: bool = False) -> float:
    """1.0 if the completion's final answer equals `answer`, else 0.0. Never raises."""
    try:
        if not isinstance(completion, str) or not isinstance(answer, str):
            return 0.0
        predicted = extract_answer(completion, last_number_fallback)
        reference = reference_answer(answer)
        if predicted is None or hedged(completion) or lists_alternatives(predicted, reference):
            return 0.0
        return 1.0 if answers_match(predicted, reference) else 0.0
    except Exception:  # a reward must never take the rollout down
        return 0.0
