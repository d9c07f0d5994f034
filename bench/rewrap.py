"""Rewrap what ruff's formatter leaves over a width: comments, docstrings and string literals.

    python bench/rewrap.py [--width 100] [--stable 120] PATH ...   # then: ruff format PATH ...

Issue 33 asks for at most 3% of the package's lines over 100 characters; the formatter, at the
project's 120, splits code but never text. This script, run before ``ruff format`` (twice, as a
rewrap can make code the formatter then moves):

- rewraps blocks of full-line comments and docstring paragraphs (list items keep their hanging
  indent) with a line over ``--width``; inline literals (````a b````) stay on one line, and a last
  line of a few characters takes words from the lines above;
- moves a trailing comment that makes its line too long onto its own line(s) above it (into the
  block, under ``else:`` / ``except ...:`` / ``finally:`` / ``elif ...:``);
- re-splits runs of implicitly concatenated string literals (one part per line, inside brackets) at
  spaces outside f-string fields, with the same value, unless the whole would fit in ``--stable``
  characters: ruff's formatter joins such a run back onto one line.

It leaves alone (and lists) what it cannot do safely: pragmas (``# noqa``, ``# type:``),
separator comments, literal blocks (``::``, ``>>>``), strings with mixed quotes or prefixes, code.
A file is written only if its syntax tree is unchanged but for the whitespace of docstrings, and
its comments hold the same words in the same order.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PRAGMA = re.compile(r"#\s*(noqa|type:|pragma|fmt:|nosec|pyright|mypy)")
MARKER = re.compile(r"^(- |\* |\d+\. |\(\w\) )")
ORPHAN = 24  # a last line shorter than this takes words from the lines above
TAILS = ("", ",", ")", "),", ":", "]", "],", "))", ")]", "):")


@dataclass
class Edits:
    """Replacements of line ranges of one file (1-based first line -> (lines replaced, new lines))."""

    where: str
    by_line: dict[int, tuple[int, list[str]]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def replace(self, first: int, count: int, lines: list[str]) -> None:
        self.by_line.setdefault(first, (count, lines))

    def skip(self, line: int, why: str) -> None:
        self.skipped.append(f"{self.where}:{line}: {why}")

    def apply(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        n = 1
        while n <= len(lines):
            if n in self.by_line:
                count, new = self.by_line[n]
                out.extend(new)
                n += count
            else:
                out.append(lines[n - 1])
                n += 1
        return out


def indentation(line: str) -> int:
    return len(line) - len(line.lstrip())


# ---------------------------------------------------------------------------------- filling words


def glue(words: list[str]) -> list[str]:
    """Words inside an inline literal (````a b```` or ```a b```) stay together."""
    out: list[str] = []
    for word in words:
        if out and (out[-1].count("``") % 2 or out[-1].replace("``", "").count("`") % 2):
            out[-1] += " " + word
        else:
            out.append(word)
    return out


def greedy(words: list[str], first_room: int, room: int) -> list[str]:
    """Greedy fill: the first line holds ``first_room`` characters, the others ``room``."""
    out: list[str] = []
    line = ""
    limit = first_room
    for word in glue(words):
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= limit:
            line += " " + word
        else:
            out.append(line)
            line = word
            limit = room
    if line:
        out.append(line)
    return out


def fill(words: list[str], first_room: int, room: int) -> list[str]:
    """Greedy fill; when the last line would be short, the least narrowing that keeps the line count
    and lengthens it."""
    best = greedy(words, first_room, room)
    if len(best) < 2 or len(best[-1]) >= ORPHAN:
        return best
    for narrower in range(1, 51 if len(best) == 2 else 31):
        got = greedy(words, first_room - narrower, room - narrower)
        if len(got) != len(best):
            break
        if len(got[-1]) >= ORPHAN:
            return got
    return best


# ---------------------------------------------------------------------------------- docstrings


def docstring_lines(tree: ast.AST) -> list[tuple[int, int]]:
    """(first, last) line of every docstring."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append((first.lineno, first.end_lineno or first.lineno))
    return found


def rewrap_paragraph(lines: list[str], width: int) -> list[str] | str:
    """A paragraph's lines rewrapped, item by item (prose, or list items with a hanging indent), or
    why it is left alone."""
    base = indentation(lines[0])
    items: list[list[str]] = []
    hangs: list[int] = []
    for line in lines:
        text = line.strip()
        if text.startswith((">>>", "|", "..", "```")) or text.endswith("::"):
            return "a literal block or a table"
        if indentation(line) == base:
            marker = MARKER.match(text)
            if marker or not items or hangs[-1] != base:
                items.append([line])
                hangs.append(base + (len(marker.group(0)) if marker else 0))
            else:
                items[-1].append(line)
        elif items and indentation(line) == hangs[-1] != base:
            items[-1].append(line)
        else:
            return f"indentation {indentation(line)} in a paragraph at {base}"
    out: list[str] = []
    for item, hang in zip(items, hangs):
        if not any(len(line) > width for line in item):
            out.extend(item)
            continue
        wrapped = fill(" ".join(line.strip() for line in item).split(), width - base, width - hang)
        out.append(" " * base + wrapped[0])
        out.extend(" " * hang + line for line in wrapped[1:])
    return out


def _ends_literal(paragraph: list[str]) -> bool:
    return bool(paragraph) and paragraph[-1].rstrip().endswith("::")


def rewrap_docstring(chunk: list[str], width: int) -> list[str] | str:
    """A docstring's lines rewrapped where one is over ``width``, or why they are left alone."""
    indent = indentation(chunk[0])
    opening = re.match(r'^\s*([rRuU]?)("""|\'\'\')', chunk[0])
    if not opening:
        return "not triple quoted"
    opener, quote = opening.group(1) + opening.group(2), opening.group(2)
    if len(chunk) == 1:
        body = chunk[0].strip()[len(opener) :]
        if not body.endswith(quote):
            return "code after a one-line docstring"
        words = body[: -len(quote)].split()
        words[0], words[-1] = opener + words[0], words[-1] + quote
        return [" " * indent + line for line in fill(words, width - indent, width - indent)]
    # the opener and the closing quote take room: placeholders of their length, glued to the text
    inner = [" " * indent + "\x00" * len(opener) + chunk[0].strip()[len(opener) :], *chunk[1:]]
    closing_alone = inner[-1].strip() == quote
    if closing_alone:
        inner.pop()
    elif inner[-1].rstrip().endswith(quote):
        inner[-1] = inner[-1].rstrip()[: -len(quote)] + "\x01" * len(quote)
    else:
        return "code after the closing quotes"
    paragraphs: list[list[str]] = [[]]
    for line in inner:
        if line.strip():
            paragraphs[-1].append(line)
        else:
            paragraphs.append([])
    out: list[str] = []
    literal = False  # inside a literal block: the paragraphs after one ending in "::", indented
    for i, paragraph in enumerate(paragraphs):
        if i:
            out.append("")
        literal = bool(paragraph) and (literal or (i > 0 and _ends_literal(paragraphs[i - 1])))
        literal = literal and indentation(paragraph[0]) > indent
        if paragraph and not literal and any(len(line) > width for line in paragraph):
            wrapped = rewrap_paragraph(paragraph, width)
            if isinstance(wrapped, str):
                return wrapped
            out.extend(wrapped)
        else:
            out.extend(paragraph)
    text = re.sub("\x00+", opener, "\n".join(out), count=1).replace("\x01" * len(quote), quote)
    if "\x00" in text or "\x01" in text:
        return "the quotes would part from the text"
    lines = text.split("\n") + ([" " * indent + quote] if closing_alone else [])
    return [line.rstrip() if line.strip() else "" for line in lines]


# ---------------------------------------------------------------------------------- comments


def rewrap_comment_block(lines: list[str], width: int) -> list[str] | str:
    """Full-line comments at one indentation rewrapped (a bare ``#`` parts paragraphs, a list item
    keeps its hanging indent), or why they are left alone."""
    indent = indentation(lines[0])
    texts = [line.strip() for line in lines]
    if any(PRAGMA.match(t) or t.startswith(("# --", "# ==", "#!")) for t in texts):
        return "a pragma or a separator"
    if any(not (t.startswith("# ") or t == "#") for t in texts):
        return "a comment without '# '"
    out: list[str] = []
    paragraph: list[str] = []
    hang = 0

    def flush() -> None:
        if paragraph:
            room = width - indent - 2
            wrapped = fill(" ".join(paragraph).split(), room, room - hang)
            out.append(" " * indent + "# " + wrapped[0])
            out.extend(" " * indent + "# " + " " * hang + line for line in wrapped[1:])
        paragraph.clear()

    for line, text in zip(lines, texts):
        body = text[1:].strip()
        if not body:
            flush()
            out.append(" " * indent + "#")
            continue
        lead = indentation(line[indent + 2 :])
        marker = MARKER.match(body)
        if marker and not lead:
            flush()
            hang = len(marker.group(0))
        elif lead and not (paragraph and lead == hang):
            return "an indented comment"
        elif not lead and hang:
            flush()
            hang = 0
        paragraph.append(body)
    flush()
    return out


def rewrap_comments(lines: list[str], comment_lines: set[int], width: int, edits: Edits) -> None:
    n = 1
    while n <= len(lines):
        if n not in comment_lines:
            n += 1
            continue
        first = n
        while n + 1 in comment_lines and indentation(lines[n]) == indentation(lines[first - 1]):
            n += 1
        block = lines[first - 1 : n]
        n += 1
        if any(len(line) > width for line in block):
            wrapped = rewrap_comment_block(block, width)
            if isinstance(wrapped, str):
                edits.skip(first, wrapped)
            else:
                edits.replace(first, len(block), wrapped)


def move_trailing_comments(lines: list[str], tokens: list[tokenize.TokenInfo], width: int, edits: Edits) -> None:
    for token in tokens:
        line = lines[token.start[0] - 1]
        code = line[: token.start[1]].rstrip()
        if token.type != tokenize.COMMENT or not code.strip() or len(line) <= width:
            continue
        number, indent, words = token.start[0], indentation(line), token.string[1:].split()
        if PRAGMA.match(token.string):
            edits.skip(number, "a trailing pragma")
        elif code.lstrip().startswith(("except", "else", "finally", "elif")) and code.endswith(":"):
            inner = " " * (indent + 4) + "# "
            edits.replace(number, 1, [code, *(inner + w for w in fill(words, width - len(inner), width - len(inner)))])
        elif number > 1 and lines[number - 2].lstrip().startswith("#") and indentation(lines[number - 2]) == indent:
            edits.skip(number, "a trailing comment under a comment")
        else:
            above = " " * indent + "# "
            edits.replace(number, 1, [*(above + w for w in fill(words, width - len(above), width - len(above))), code])


# ---------------------------------------------------------------------------------- strings


def literal_words(body: str, is_f: bool) -> list[str] | None:
    """A literal's body cut after each run of spaces outside f-string fields (None: not understood)."""
    words: list[str] = []
    current = ""
    depth = 0
    i = 0
    while i < len(body):
        c = body[i]
        if is_f and c in "{}" and depth == 0 and body[i : i + 2] in ("{{", "}}"):
            current += body[i : i + 2]
            i += 2
            continue
        if c == "\\":
            current += body[i : i + 2]
            i += 2
            continue
        if is_f and c == "{":
            depth += 1
        elif is_f and c == "}":
            if depth == 0:
                return None
            depth -= 1
        current += c
        if c == " " and depth == 0 and body[i + 1 : i + 2] != " ":
            words.append(current)
            current = ""
        i += 1
    if depth:
        return None
    return [*words, current] if current else words


@dataclass(frozen=True)
class Literal:
    """How the parts of a run are written: their common prefix (``r`` or none), quote, and whether
    any is an f-string (then every body is held in f-string form)."""

    raw: str
    quote: str
    is_f: bool

    def write(self, body: str) -> str:
        if self.is_f and "{" in body.replace("{{", ""):
            return f"{self.raw}f{self.quote}{body}{self.quote}"
        if self.is_f:
            body = body.replace("{{", "{").replace("}}", "}")
        return f"{self.raw}{self.quote}{body}{self.quote}"


def read_run(texts: list[str]) -> tuple[Literal, str] | str:
    """The parts' common form and their bodies joined, or why the run is left alone."""
    parts = []
    for text in texts:
        part = re.match(r"^([rRfFuU]*)(\"|')(.*)(\2)$", text, re.S)
        if not part or part.group(3).startswith(part.group(2) * 2):
            return "a triple-quoted or bytes part"
        parts.append((part.group(1).lower().replace("u", ""), part.group(2), part.group(3)))
    if len({p.replace("f", "") for p, _, _ in parts}) != 1 or len({q for _, q, _ in parts}) != 1:
        return "mixed prefixes or quotes"
    form = Literal(parts[0][0].replace("f", ""), parts[0][1], any("f" in p for p, _, _ in parts))
    body = "".join(b.replace("{", "{{").replace("}", "}}") if form.is_f and "f" not in p else b for p, _, b in parts)
    return form, body


def group_words(words: list[str], form: Literal, first_room: int, room: int) -> list[str]:
    pieces: list[str] = []
    current = ""
    for word in words:
        limit = first_room if not pieces else room
        if not current or len(form.write(current + word)) <= limit:
            current += word
        else:
            pieces.append(current)
            current = word
    return [*pieces, current]


def split_run(lead: str, indent: int, tail: str, form: Literal, body: str, width: int) -> list[str] | str:
    """A run's new lines: ``lead`` before the first part, ``tail`` after the last."""
    words = literal_words(body, form.is_f)
    if words is None:
        return "an f-string not understood"
    pieces = group_words(words, form, width - len(lead), width - indent)
    if len(pieces) > 1 and len(pieces[-1]) < ORPHAN:
        for narrower in range(1, 31):
            got = group_words(words, form, width - len(lead) - narrower, width - indent - narrower)
            if len(got) != len(pieces):
                break
            if len(got[-1]) >= ORPHAN:
                pieces = got
                break
    last_lead = lead if len(pieces) == 1 else " " * indent
    if len(last_lead + form.write(pieces[-1]) + tail) > width:
        last_words = literal_words(pieces[-1], form.is_f) or [pieces[-1]]
        if len(last_words) > 1:
            pieces[-1:] = ["".join(last_words[:-1]), last_words[-1]]
    new = [(lead if not i else " " * indent) + form.write(piece) for i, piece in enumerate(pieces)]
    new[-1] += tail
    if any(len(line) > width for line in new):
        return "a word longer than the line"
    return new


def string_runs(tokens: list[tokenize.TokenInfo]) -> Iterable[list[tokenize.TokenInfo]]:
    """Runs of string tokens with nothing but line breaks between them."""
    run: list[tokenize.TokenInfo] = []
    for token in tokens:
        if token.type == tokenize.STRING:
            run.append(token)
        elif token.type != tokenize.NL or not run:
            if run:
                yield run
            run = []
    if run:
        yield run


def rewrap_strings(lines: list[str], tokens: list[tokenize.TokenInfo], width: int, stable: int, edits: Edits) -> None:
    depth_at: dict[tuple[int, int], int] = {}
    depth = 0
    for token in tokens:
        depth_at[token.start] = depth
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
    for run in string_runs(tokens):
        first, last = run[0].start[0], run[-1].end[0]
        old = lines[first - 1 : last]
        if not any(len(line) > width for line in old) or any(t.start[0] != t.end[0] for t in run):
            continue
        lead = lines[first - 1][: run[0].start[1]]
        tail = lines[last - 1][run[-1].end[1] :].rstrip()
        why = ""
        if depth_at[run[0].start] == 0:
            why = "a string outside brackets"
        elif len({t.start[0] for t in run}) != len(run) or last - first + 1 != len(run):
            why = "not one part per line"
        elif any(lines[t.start[0] - 1][: t.start[1]].strip() for t in run[1:]):
            why = "a part after code"
        elif tail not in TAILS:
            why = f"code after the string: {tail!r}"
        if why:
            edits.skip(first, why)
            continue
        read = read_run([t.string for t in run])
        if isinstance(read, str):
            edits.skip(first, read)
            continue
        form, body = read
        if len(lead + form.write(body) + tail) <= stable:
            edits.skip(first, f"fits in {stable} on one line: the formatter would join it")
            continue
        new = split_run(lead, indentation(lead), tail, form, body, width)
        if isinstance(new, str):
            edits.skip(first, new)
        elif new != old:
            edits.replace(first, len(old), new)


# ---------------------------------------------------------------------------------- files


def normalised_tree(text: str) -> str:
    """The syntax tree, docstrings with their whitespace collapsed."""
    tree = ast.parse(text)
    for start, _ in docstring_lines(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.lineno == start:
                node.value = " ".join(node.value.split())
    return ast.dump(tree)


def comment_words(text: str) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return " ".join(t.string.lstrip("#") for t in tokens if t.type == tokenize.COMMENT).split()


def rewrap(path: Path, width: int, stable: int) -> tuple[bool, list[str]]:
    """Rewrap one file in place; whether it changed, and what was left alone."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    tree = ast.parse(text)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    edits = Edits(str(path))
    for first, last in docstring_lines(tree):
        chunk = lines[first - 1 : last]
        if any(len(line) > width for line in chunk):
            wrapped = rewrap_docstring(chunk, width)
            if isinstance(wrapped, str):
                edits.skip(first, f"docstring: {wrapped}")
            else:
                edits.replace(first, len(chunk), wrapped)
    comment_lines = {t.start[0] for t in tokens if t.type == tokenize.COMMENT and not t.line[: t.start[1]].strip()}
    rewrap_comments(lines, comment_lines, width, edits)
    rewrap_strings(lines, tokens, width, stable, edits)
    move_trailing_comments(lines, tokens, width, edits)
    if not edits.by_line:
        return False, edits.skipped
    new_text = "\n".join(edits.apply(lines))
    if normalised_tree(new_text) != normalised_tree(text) or comment_words(new_text) != comment_words(text):
        return False, [*edits.skipped, f"{path}: NOT WRITTEN: the rewrap would change the code or a comment"]
    path.write_text(new_text, encoding="utf-8")
    return True, edits.skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="Python files or directories")
    parser.add_argument("--width", type=int, default=100, help="the line length to rewrap to")
    parser.add_argument("--stable", type=int, default=120, help="the formatter's line length")
    parser.add_argument("--quiet", action="store_true", help="do not list what was left alone")
    args = parser.parse_args()
    files = [
        p for name in args.paths for p in (sorted(Path(name).rglob("*.py")) if Path(name).is_dir() else [Path(name)])
    ]
    changed = 0
    for path in files:
        wrote, skipped = rewrap(path, args.width, args.stable)
        changed += wrote
        if skipped and not args.quiet:
            print("\n".join(skipped))
    print(f"{changed} of {len(files)} files rewrapped", file=sys.stderr)


if __name__ == "__main__":
    main()
