"""``python -m lightning_putm table``: marks, paired tests with Holm's correction, refusals, and the three formats.

Every run folder here is written by the project's own writer (:func:`~lightning_putm.evaluation.report.write_report`)
from real episode banks (:func:`~lightning_putm.data.episodes.sample_episode_bank` on a toy label vector) and
hand-made per-task accuracies, with the ``config.yaml`` ``evaluate.py`` would write; so the table reads exactly
the files an evaluation leaves, and every mark is known in advance from how the accuracies were built.
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy import stats

from lightning_putm.config import to_yaml
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.errors import DataError
from lightning_putm.evaluation.records import Provenance
from lightning_putm.evaluation.report import write_report
from lightning_putm.evaluation.runner import SettingResult
from lightning_putm.evaluation.settings import load_evaluate_config
from lightning_putm.studies import significance, table, table_runs

REPO = Path(__file__).resolve().parents[1]
TASKS = 20
LABELS = torch.arange(10).repeat_interleave(40)  # 10 classes of 40 rows: room for 5-way 5-shot 15-query tasks
#: the difficulty of each task: the same for every method, and wide (55–95%), so only a paired test sees small gaps
BASE = [0.75 + 0.2 * s for s in [1.0, -1.0, 0.5, -0.5] * (TASKS // 4)]
#: ±1 with sum 0 and uncorrelated with BASE's pattern: per-task noise that leaves a mean unchanged
SIGN = [1.0, 1.0, -1.0, -1.0] * (TASKS // 4)
ALT = [1.0, -1.0] * (TASKS // 2)


def gap_for_p(p: float, spread: float = 0.02) -> list[float]:
    """Per-task accuracies below ``BASE`` whose paired t-test against ``BASE`` gives the two-sided p-value ``p``.

    The differences ``c + spread·(±1)`` have mean ``c`` and sample sd ``spread·√(T/(T−1))``, so
    ``t = c·√(T−1)/spread``; ``c`` is solved from the t quantile of ``p``."""
    c = stats.t.isf(p / 2, TASKS - 1) * spread / (TASKS - 1) ** 0.5
    return [b - c - spread * a for b, a in zip(BASE, ALT)]


def result(method: str, shots: int, alpha: float | None, accuracies: list[float], seed: int = 0, queries: int = 15,
           tasks: int = TASKS, seconds: float = 1.0, oracle: bool = False) -> SettingResult:
    bank = sample_episode_bank(LABELS, 5, shots, queries, alpha, tasks, seed)
    return SettingResult(method, shots, alpha, torch.tensor(accuracies[:tasks], dtype=torch.float64), seconds, bank,
                         oracle_prior=oracle, precision="fp32")


def write_run(folder: Path, results: list[SettingResult], features: str = "feats/omniglot_conv4.pt", seed: int = 0,
              queries: int = 15) -> Path:
    """A run folder as ``evaluate.py features=<features> seed=<seed> queries=<queries>`` leaves it."""
    config = load_evaluate_config([f"features={features}", f"seed={seed}", f"queries={queries}", f"tasks={TASKS}",
                                   f"output_dir={folder}", "logger=none"])
    write_report(results, folder, to_yaml(config), Provenance("cpu (test CPU, 2 cores)", "2", "2", 1))
    return folder


def marks_run(folder: Path) -> Path:
    """Three columns (one setting each) of known verdicts:

    * 1-shot α=2: PUTM the best, PT-MAP tied with it task by task, SimpleShot 0.5 points below with noisy
      differences (p ≈ 0.6), TIM 1 point below on every task (paired p ≈ 1e-15, unpaired p ≈ 0.85), ProtoNet far
      below;
    * 5-shot α=2: three gaps of raw p 0.02, 0.03, 0.3: none survives Holm (0.06, 0.06, 0.3), two pass uncorrected;
    * 1-shot balanced: raw p 0.01, 0.02, 0.3: Holm rejects two (0.03, 0.04), Bonferroni only one (0.03, 0.06).
    """
    return write_run(folder, [
        result("putm", 1, 2.0, BASE, seconds=4.0),
        result("ptmap", 1, 2.0, BASE),
        result("simpleshot", 1, 2.0, [b - 0.005 + 0.04 * s for b, s in zip(BASE, SIGN)]),
        result("tim", 1, 2.0, [b - 0.01 + 0.002 * s for b, s in zip(BASE, SIGN)]),
        result("protonet", 1, 2.0, [b - 0.2 for b in BASE]),
        result("putm", 5, 2.0, BASE),
        result("simpleshot", 5, 2.0, gap_for_p(0.02)),
        result("ptmap", 5, 2.0, gap_for_p(0.03)),
        result("tim", 5, 2.0, gap_for_p(0.3)),
        result("putm", 1, None, BASE),
        result("simpleshot", 1, None, gap_for_p(0.01)),
        result("ptmap", 1, None, gap_for_p(0.02)),
        result("tim", 1, None, gap_for_p(0.3)),
    ])


@pytest.fixture(scope="module")
def marks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return marks_run(tmp_path_factory.mktemp("table") / "marks")


def read_summary(folder: Path) -> dict[tuple[str, str, str], dict[str, str]]:
    with open(folder / "results.csv", newline="") as handle:
        return {(r["method"], r["shots"], r["alpha"]): r for r in csv.DictReader(handle)}


def csv_rows(text: str) -> dict[tuple[str, str, str], dict[str, str]]:
    return {(r["method"], r["shots"], r["alpha"]): r for r in csv.DictReader(io.StringIO(text))}


def block(markdown: str, heading: str) -> list[str]:
    """The table lines under ``**heading**``."""
    lines = markdown.splitlines()
    start = lines.index(f"**{heading}**") + 2
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def test_best_second_and_marks_on_a_tie_a_significant_and_a_non_significant_gap(marks: Path) -> None:
    """Kills: the best chosen by the lowest mean; the second taken as the runner-up row even when it ties with the
    best (PT-MAP would be underlined); an unpaired test (TIM's constant 1-point gap would get the mark); the mark
    missing on a tie or put on the best itself; the ± not results.csv's CI; rows out of the project's order."""
    text = table.render_markdown(table_runs.make_table([marks]), table.Options())
    ci = {m: f"{float(read_summary(marks)[(m, '1', '2')]['ci95']):.2f}"
          for m in ("putm", "ptmap", "simpleshot", "tim", "protonet")}
    lines = block(text, "Dirichlet α = 2")
    assert lines[:2] == ["| Method | omniglot\\_conv4 1-shot | omniglot\\_conv4 5-shot |", "|:---|:---:|:---:|"]
    one_shot = [line.split(" | ")[:2] for line in lines[2:]]
    assert one_shot == [["| PUTM", f"**75.00** ± {ci['putm']}"],
                        ["| PT-MAP", f"**75.00** ± {ci['ptmap']} †"],
                        ["| SimpleShot", f"<ins>74.50</ins> ± {ci['simpleshot']} †"],
                        ["| TIM", f"74.00 ± {ci['tim']}"],
                        ["| ProtoNet", f"55.00 ± {ci['protonet']}"]]
    assert lines[-1] == f"| ProtoNet | 55.00 ± {ci['protonet']} | — |"  # no 5-shot result: a dash
    assert text.startswith("Accuracy (%) ± 95% CI over 20 tasks per cell. **Bold**: best of its column; "
                           "<ins>underlined</ins>: second; †: not significantly different")
    # an unpaired test would not separate TIM from PUTM: the paired design is what makes the verdict
    tim = [b - 0.01 + 0.002 * s for b, s in zip(BASE, SIGN)]
    assert stats.ttest_ind(BASE, tim).pvalue > 0.5 and significance.paired_t_pvalue(BASE, tim) < 1e-10


def test_holm_changes_the_verdict_and_the_p_values_are_scipys_paired_t(marks: Path) -> None:
    """Kills: no multiple-comparison correction (5-shot: SimpleShot and PT-MAP would lose their mark), Bonferroni
    instead of Holm (1-shot balanced: PT-MAP would get one), a Wilcoxon or unpaired p-value in the CSV, a Holm
    p-value not adjusted by hand's rule."""
    rows = csv_rows(table.render_csv(table_runs.make_table([marks]), table.Options()))
    expected = {("5", "2"): {"simpleshot": "true", "ptmap": "true", "tim": "true"},
                ("1", "balanced"): {"simpleshot": "false", "ptmap": "false", "tim": "true"}}
    for (shots, alpha), verdicts in expected.items():
        assert rows[("putm", shots, alpha)]["reference"] == "true"
        assert rows[("putm", shots, alpha)]["not_significantly_different"] == ""
        raw = []
        for method, verdict in verdicts.items():
            assert rows[(method, shots, alpha)]["not_significantly_different"] == verdict, (method, shots, alpha)
            scipy_p = stats.ttest_rel(BASE, gap_for_p({"5": {"simpleshot": 0.02, "ptmap": 0.03, "tim": 0.3},
                                                        "1": {"simpleshot": 0.01, "ptmap": 0.02, "tim": 0.3}}
                                                       [shots][method])).pvalue
            assert float(rows[(method, shots, alpha)]["p_value"]) == pytest.approx(scipy_p, rel=1e-3)
            raw.append(float(rows[(method, shots, alpha)]["p_value"]))
        assert [float(rows[(m, shots, alpha)]["p_holm"]) for m in verdicts] == pytest.approx(
            [min(1.0, 3 * raw[0]), max(min(1.0, 3 * raw[0]), 2 * raw[1]), raw[2]], rel=1e-5)
    ptmap = rows[("ptmap", "1", "balanced")]  # Holm rejects it (2·p ≤ 0.05) where Bonferroni (3·p) would not
    assert float(ptmap["p_holm"]) <= 0.05 < 3 * float(ptmap["p_value"])


def test_holm_and_the_paired_t_test_by_hand() -> None:
    """Kills: Holm without its monotone step (0.08 for the third), Bonferroni (m·p), adjusted values returned in
    sorted instead of the given order; a tie (every difference 0) not p = 1, a constant gap not p = 0."""
    assert significance.holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert significance.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert significance.holm([]) == []
    assert significance.paired_t_pvalue([0.5, 0.7, 0.9], [0.5, 0.7, 0.9]) == 1.0
    assert significance.paired_t_pvalue([0.5, 0.75, 1.0], [0.25, 0.5, 0.75]) == 0.0
    first, second = [0.8, 0.6, 0.9, 0.7, 0.75], [0.7, 0.65, 0.8, 0.6, 0.7]
    assert significance.paired_t_pvalue(first, second) == pytest.approx(stats.ttest_rel(first, second).pvalue)


@pytest.mark.parametrize(("other", "difference"), [
    ({"seed": 1}, "seed 0 vs 1"),
    ({"queries": 10}, "queries 15 vs 10"),
    ({"tasks": 10}, "20 vs 10 tasks"),
])
def test_runs_on_different_episode_banks_are_refused_naming_the_difference(tmp_path: Path, other: dict,
                                                                          difference: str) -> None:
    """Kills: a merge of runs evaluated on different seeds, query counts or task counts (their tasks are not
    paired), and a message that does not say which runs and what differs."""
    first = write_run(tmp_path / "a", [result("putm", 1, 2.0, BASE)])
    seed, queries, tasks = other.get("seed", 0), other.get("queries", 15), other.get("tasks", TASKS)
    second = write_run(tmp_path / "b", [result("simpleshot", 1, 2.0, BASE, seed=seed, queries=queries, tasks=tasks)],
                       seed=seed, queries=queries)
    with pytest.raises(DataError) as caught:
        table_runs.make_table([first, second])
    assert str(caught.value).startswith(f"runs {first} and {second} evaluated 1-shot alpha=2 on omniglot_conv4 on "
                                        f"different episode banks: {difference};")


def test_the_banks_are_compared_task_by_task_and_only_where_runs_share_a_cell(tmp_path: Path) -> None:
    """Kills: a bank check on the config alone (a per-task file whose tasks differ passes), and a refusal of runs
    that differ in seed but share no (source, shot, setting) cell."""
    first = write_run(tmp_path / "a", [result("putm", 1, 2.0, BASE)])
    elsewhere = write_run(tmp_path / "c", [result("simpleshot", 5, 2.0, BASE, seed=3)], seed=3)
    assert {c.shots for c in table_runs.make_table([first, elsewhere]).columns} == {1, 5}
    second = write_run(tmp_path / "b", [result("simpleshot", 1, 2.0, BASE)])
    path = second / "per_task.csv"
    rows = list(csv.DictReader(open(path, newline="")))
    rows[3]["query_counts"] = "1;2;3;4;5"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(DataError, match=r"different episode banks: task 3 has query counts .* vs 1;2;3;4;5;"):
        table_runs.make_table([first, second])


def test_runs_on_one_bank_merge_and_a_result_given_twice_must_agree(tmp_path: Path) -> None:
    """Kills: methods of two runs on the same bank not merged into one column (or not tested against each other),
    an identical duplicate refused, a conflicting duplicate silently kept."""
    first = write_run(tmp_path / "a", [result("putm", 1, 2.0, BASE), result("simpleshot", 1, 2.0, BASE)])
    second = write_run(tmp_path / "b", [result("tim", 1, 2.0, [b - 0.01 for b in BASE]),
                                        result("simpleshot", 1, 2.0, BASE)])
    merged = table_runs.make_table([first, second])
    assert [row.method for row in merged.rows] == ["putm", "simpleshot", "tim"] and len(merged.columns) == 1
    rows = csv_rows(table.render_csv(merged, table.Options()))
    assert rows[("tim", "1", "2")]["p_value"] == "0" and rows[("tim", "1", "2")]["run"] == str(second)
    third = write_run(tmp_path / "c", [result("simpleshot", 1, 2.0, [b - 0.01 for b in BASE])])
    with pytest.raises(DataError, match=r"^SimpleShot 1-shot alpha=2 on omniglot_conv4 appears in runs .*a and .*c "
                                        r"with different results \(75\.00 ± .* vs 74\.00 ± .*\); give only one"):
        table_runs.make_table([first, third])


def test_missing_or_out_of_step_files_are_refused(tmp_path: Path) -> None:
    """Kills: a table built without per-task data (no paired test possible), and results.csv trusted when
    per_task.csv says otherwise."""
    folder = write_run(tmp_path / "a", [result("putm", 1, 2.0, BASE)])
    summary = (folder / "results.csv").read_text()
    (folder / "results.csv").write_text(summary.replace(",75.0,", ",76.0,"))
    with pytest.raises(DataError, match=r"results.csv gives PUTM 1-shot alpha=2 on omniglot_conv4 as 76\.0000 ± "
                                        r".* per_task.csv 75\.0000 ± .*out of step"):
        table_runs.make_table([folder])
    (folder / "per_task.csv").unlink()
    with pytest.raises(DataError, match=rf"^{re.escape(str(folder / 'per_task.csv'))}: not found; the table needs "
                                        "per-task accuracies"):
        table_runs.make_table([folder])


def test_sources_are_labelled_and_a_clash_of_derived_labels_is_refused(tmp_path: Path) -> None:
    """Kills: two different feature sources merged silently because their derived names agree, and ``--label``
    not applied (or not able to merge on purpose)."""
    first = write_run(tmp_path / "a", [result("putm", 1, 2.0, BASE)], features="one/feats.pt")
    second = write_run(tmp_path / "b", [result("tim", 1, 2.0, BASE)], features="two/feats.pt")
    with pytest.raises(DataError, match=r"both labelled 'feats' but evaluated different sources \(features one/feats"
                                        r"\.pt vs features two/feats\.pt\); give each its own name with --label"):
        table_runs.make_table([first, second])
    labels = table.parse_labels([f"{first}=Omniglot = A", f"{second}=Mine"], [first, second])
    assert [c.source for c in table_runs.make_table([first, second], labels).columns] == ["Omniglot = A", "Mine"]
    same = table_runs.make_table([first, second], table.parse_labels([f"{first}=X", f"{second}=X"], [first, second]))
    assert len(same.columns) == 1 and "merged under 'X' as --label asked" in same.notes[0]
    assert table_runs.source_of({"checkpoint": "ck/omniglot/conv4/r/s2m2r/best.ckpt", "split": "val",
                            "data": {"name": "omniglot", "backbone": "conv4"}})[1] == "omniglot conv4 (val)"
    assert table_runs.source_of({"checkpoint": "timm:resnet18", "data": {"name": "cub"}})[1] == "cub resnet18"
    assert table_runs.source_of({"features": "auto"}) == ("the built-in demo", "digits pixels")


def test_settings_sort_numerically_and_a_protocol_key_is_one_more_setting() -> None:
    """Kills: α sorted as text (10 before 2), balanced before the α blocks, a K_eff (query_classes) column ignored
    or an absent/null one taken as a setting of its own."""
    settings = [table_runs.Setting.of(row) for row in (
        {"alpha": "balanced"}, {"alpha": "10"}, {"alpha": "2", "query_classes": "null"}, {"alpha": "0.5"},
        {"alpha": "balanced", "query_classes": "5"}, {"alpha": "balanced", "query_classes": "3"})]
    ordered = sorted(settings, key=table_runs.Setting.sort_key)
    assert [s.label for s in ordered] == ["Dirichlet α = 0.5", "Dirichlet α = 2", "Dirichlet α = 10", "balanced",
                                          "K_eff = 3, balanced", "K_eff = 5, balanced"]
    assert ordered[-1].code == "query_classes=5;alpha=balanced"
    assert table_runs.Setting.of({"alpha": "2", "query_classes": ""}) == table_runs.Setting.of({"alpha": "2"})


def test_time_per_1000_tasks_and_oracle_rows_are_not_ranked(tmp_path: Path) -> None:
    """Kills: the time column showing the run's seconds rather than per 1000 tasks, or not averaged over the
    block's columns; an oracle-prior result (given the true counts) made best of its column."""
    folder = write_run(tmp_path / "a", [
        result("putm", 1, 2.0, BASE, seconds=3.0), result("putm", 5, 2.0, BASE, seconds=5.0),
        result("simpleshot", 1, 2.0, [b - 0.1 for b in BASE], seconds=0.2),
        result("putm", 1, 2.0, [min(1.0, b + 0.1) for b in BASE], oracle=True)])
    text = table.render_markdown(table_runs.make_table([folder]), table.Options(time=True))
    lines = block(text, "Dirichlet α = 2")
    assert lines[0].endswith("| time (s / 1000 tasks) |")
    assert lines[2].startswith("| PUTM | **75.00** ±") and lines[2].endswith(" | 200 |")  # (150 + 250) / 2
    assert lines[3].startswith("| PUTM (oracle prior) | 83.75 ± ") and "**" not in lines[3] and "†" not in lines[3]
    assert lines[4].startswith("| SimpleShot | <ins>65.00</ins> ±") and lines[4].endswith(" | — | 10.0 |")
    assert "Oracle-prior rows were given the true query counts and are not ranked" in text
    assert "measured on cpu (test CPU, 2 cores)" in text


def latex_problems(text: str, methods: list[str]) -> list[str]:
    """What a LaTeX table would get wrong without running LaTeX: unbalanced braces, a row whose cells (a
    ``\\multicolumn`` counting its span) differ from the tabular's columns, booktabs rules missing or misplaced,
    a method row missing."""
    problems = []
    unescaped = re.sub(r"\\[{}]", "", text.replace("\\\\", ""))
    depth = 0
    for ch in unescaped:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            problems.append("a } closes nothing")
            break
    if depth > 0:
        problems.append("unclosed {")
    spec = re.search(r"\\begin\{tabular\}\{([^}]*)\}", text)
    if spec is None:
        return problems + ["no tabular"]
    width = len(re.findall(r"[lcr]", spec.group(1)))
    body = text[spec.end():text.index(r"\end{tabular}")]
    for line in body.splitlines():
        if not line.rstrip().endswith(r"\\"):
            continue
        cells = re.split(r"(?<!\\)&", line.rstrip()[:-2])
        count = sum(int(m.group(1)) if (m := re.match(r"\s*\\multicolumn\{(\d+)\}", cell)) else 1 for cell in cells)
        if count != width:
            problems.append(f"{count} columns instead of {width}: {line}")
    rules = re.findall(r"\\(toprule|midrule|bottomrule)", body)
    if not rules or rules[0] != "toprule" or rules[-1] != "bottomrule" or "midrule" not in rules:
        problems.append(f"booktabs rules out of place: {rules}")
    if r"\hline" in body:
        problems.append("\\hline in a booktabs table")
    rows = [line.split("&")[0].strip() for line in body.splitlines() if "&" in line]
    problems += [f"no row of {m}" for m in methods if m not in rows]
    return problems


def test_latex_is_booktabs_with_balanced_braces_equal_column_counts_and_escaped_labels(marks: Path) -> None:
    """Kills: a row with one cell too many or few (a \\multicolumn span wrong), \\hline instead of booktabs, a
    label's ``_ & % #`` written raw (LaTeX errors), α written as Unicode (pdflatex fails), marks not as
    \\textbf/\\underline/$^\\dagger$."""
    labels = table.parse_labels([f"{marks}=Omni_glot & 50% #1"], [marks])
    text = table.render_latex(table_runs.make_table([marks], labels), table.Options(time=True))
    assert latex_problems(text, ["PUTM", "PT-MAP", "SimpleShot", "TIM", "ProtoNet"]) == []
    assert r"\multicolumn{2}{c}{Omni\_glot \& 50\% \#1}" in text and r"\cmidrule(lr){2-3}" in text
    assert r"\multicolumn{4}{l}{\textit{Dirichlet $\alpha$ = 2}} \\" in text and "α" not in text
    assert re.search(r"^PUTM & \\textbf\{75\.00\} \$\\pm\$ \d+\.\d\d & ", text, re.M)
    assert re.search(r"^SimpleShot & \\underline\{74\.50\} \$\\pm\$ \d+\.\d\d\$\^\\dagger\$ & ", text, re.M)
    assert latex_problems(text.replace(r"\bottomrule", r"\hline"), []) != []  # the checker itself catches a fault
    assert latex_problems(text.replace("PT-MAP & ", "PT-MAP & & ", 1), []) != []


@pytest.mark.skipif(not (shutil.which("pdflatex") or shutil.which("lualatex")), reason="no TeX engine on PATH")
def test_latex_compiles(marks: Path, tmp_path: Path) -> None:
    """Kills: any LaTeX error the structural check misses (run only where a TeX engine is installed)."""
    engine = shutil.which("pdflatex") or shutil.which("lualatex")
    body = table.render_latex(table_runs.make_table([marks]), table.Options(time=True))
    (tmp_path / "t.tex").write_text("\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n"
                                    + body + "\\end{document}\n")
    done = subprocess.run([engine, "-interaction=nonstopmode", "-halt-on-error", "t.tex"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]


def test_the_command_writes_latex_and_a_user_error_is_one_line(marks: Path, tmp_path: Path) -> None:
    """Kills: ``table`` not wired into ``python -m lightning_putm``, --format/--output/--label ignored, a bad
    --label as a traceback instead of one line and exit 2."""
    output = tmp_path / "table.tex"
    done = subprocess.run([sys.executable, "-m", "lightning_putm", "table", str(marks), "--format", "latex",
                           "--output", str(output), "--label", f"{marks}=Omniglot"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                                       "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr
    text = output.read_text()
    assert r"\multicolumn{2}{c}{Omniglot}" in text and done.stdout == "" and done.stderr == f"wrote {output}\n"
    assert latex_problems(text, ["PUTM", "PT-MAP", "SimpleShot", "TIM", "ProtoNet"]) == []
    from lightning_putm.__main__ import main

    assert main(["table", str(marks), "--label", "nowhere=X"]) == 2
