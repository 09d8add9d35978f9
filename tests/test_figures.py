"""Docstrings, comments and the guide hold no measured figure, date, seed or commit hash."""
from pathlib import Path

from rrfp.testing.figures import GUIDE, main, scan

ROOT = Path(__file__).resolve().parents[1]

# One line per kind the scanner must find, each beside prose it must leave alone.
FIGURES = {
    "3.2 ms": "replayed in 3.2 ms per step",
    "10 us": "waits 10 us",
    "4 s": "takes 4 s to start",
    "30 seconds": "after 30 seconds",
    "7 min": "ran 7 min",
    "6%": "took 6% of the gain",
    "52 GiB": "held 52 GiB",
    "512KiB": "a 512KiB buffer",
    "1.5 GB": "reads 1.5 GB",
    "80 bytes": "costs 80 bytes",
    "1.07x": "ran at 1.07x",
    "2025-01-01": "measured on 2025-01-01",
    "81c97b7": "the rule of commit 81c97b7",
    "seeds 20": "chosen on seeds 20-79",
    "seed 3": "worst on seed 3",
}
PROSE = ["a PP 2 x 2 job", "the llama3 8B model", "1F1B at hint+2", "4 stages",
         "rank 0 holds 5 microbatches", "a deadbeef value", "the hint's 2x2 grid"]


def _write(root: Path, python: str, markdown: str) -> None:
    (root / "rrfp").mkdir()
    (root / GUIDE).mkdir(parents=True)
    (root / "rrfp" / "m.py").write_text(python)
    (root / GUIDE / "page.md").write_text(markdown)


def test_the_repository_holds_no_figures_in_docstrings_comments_or_the_guide():
    assert [str(hit) for hit in scan(ROOT)] == []


def test_the_scan_finds_each_kind_of_figure(tmp_path, capsys):
    lines = list(FIGURES.values())
    python = "".join(f'def f{i}():\n    """{line}."""\n    x = 1  # {line}\n'
                     for i, line in enumerate(lines))
    _write(tmp_path, python, "".join(f"{line}.\n" for line in lines))
    found = sorted((hit.path, hit.line, hit.match) for hit in scan(tmp_path))
    guide = str(GUIDE / "page.md")
    expected = sorted([(guide, i + 1, match) for i, match in enumerate(FIGURES)]
                      + [("rrfp/m.py", 3 * i + line, match) for i, match in enumerate(FIGURES)
                         for line in (2, 3)])  # the docstring's line, then the comment's
    assert found == expected
    assert main([str(tmp_path)]) == 1
    assert "rrfp/m.py:2: 3.2 ms: replayed in 3.2 ms per step." in capsys.readouterr().out


def test_the_scan_leaves_prose_inline_code_and_fenced_blocks_alone(tmp_path, capsys):
    figure = "ran 1.07x in 3.2 ms on seed 3"
    wrapped = figure.replace(" in ", "\n    in ")  # a code span that wraps onto the next line
    python = (f'"""{" ".join(PROSE)}; ``{figure}``, ``{wrapped}``."""\n'
              f'x = "{figure}"  # `--limit 12GiB`, {PROSE[0]}\n')
    markdown = ("\n".join(PROSE) + f"\nInline `{figure}` and ``{figure}``, `{wrapped}`.\n"
                f"```\n{figure}\n```\n[a page](results/seed_3_2025-01_1.07x.md)\n")
    _write(tmp_path, python, markdown)
    assert scan(tmp_path) == []
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("no figures")
