"""Run reports: a run directory's curves as one PNG and one self-contained HTML page.

    python -m rlsys.report RUN_DIR [RUN_DIR ...]

Every stage writes its report at its end (report.png, report.html in its
output_dir); a pipeline adds a page with its summary table and every stage's
plots. The HTML embeds the images, so it can be mailed or attached as is.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import re
import sys

from rlsys.tracking.trace import TRACE_FILE
from rlsys.tracking.tracker import SAMPLES_FILE, flatten, sample_table

REPORT_PNG = "report.png"
REPORT_HTML = "report.html"
TIMELINE_PNG = "timeline.png"

# (panel title, metric names plotted in it); panels without data are left out.
PANELS: list[tuple[str, list[str]]] = [
    ("loss", ["train/loss"]),
    ("reward (sampled)", ["reward/mean"]),
    ("accuracy", ["val/accuracy", "reward/accuracy"]),
    ("response length (tokens)", ["response/length_mean", "response/length_max"]),
    ("learning rate", ["train/lr", "actor/lr"]),
    ("grad norm", ["train/grad_norm", "actor/grad_norm"]),
    ("throughput (tokens/s)", ["throughput/tokens_per_s"]),
]
PHASE_PANEL = "time per phase (s)"


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return _last_per_step([json.loads(line) for line in f if line.strip()])


def read_summary(run_dir: str) -> dict:
    path = os.path.join(run_dir, "summary.json")
    return json.load(open(path)) if os.path.isfile(path) else {}


def write_report(run_dir: str) -> str:
    """Write run_dir/report.png and run_dir/report.html; returns the HTML path."""
    rows = read_metrics(run_dir)
    png = os.path.join(run_dir, REPORT_PNG)
    plotted = plot_curves(rows, png, title=os.path.basename(os.path.abspath(run_dir)))
    body = [f"<h1>{html.escape(os.path.abspath(run_dir))}</h1>", _table(flatten(read_summary(run_dir)))]
    if plotted:
        body.append(_image(png))
    if rows:
        body += ["<h2>last values</h2>", _table({k: v for k, v in rows[-1].items()})]
    timeline = os.path.join(run_dir, TIMELINE_PNG)
    if (step := plot_step_timeline(os.path.join(run_dir, TRACE_FILE), timeline)) is not None:
        body += [f"<h2>timeline of {html.escape(step)} (trace.json: open in ui.perfetto.dev)</h2>", _image(timeline)]
    if samples := last_samples(run_dir):
        columns, data = sample_table(samples)
        body += [f"<h2>samples at step {samples[0]['step']}</h2>", _grid(columns, data)]
    return _write_html(os.path.join(run_dir, REPORT_HTML), "rlsys run report", body)


def write_pipeline_report(output_dir: str, table_markdown: str, stage_dirs: dict[str, str]) -> str:
    """output_dir/report.html: the pipeline's summary table, then each stage's plots."""
    body = [f"<h1>pipeline {html.escape(os.path.abspath(output_dir))}</h1>", _markdown_table_html(table_markdown)]
    for name, run_dir in stage_dirs.items():
        png = os.path.join(run_dir, REPORT_PNG)
        if os.path.isfile(png):
            body += [f"<h2>{html.escape(name)}</h2>", _image(png)]
    return _write_html(os.path.join(output_dir, REPORT_HTML), "rlsys pipeline report", body)


def plot_curves(rows: list[dict], path: str, title: str) -> bool:
    """One figure, one panel per metric family present in `rows`; False when nothing to plot."""
    panels = [(t, [m for m in names if _series(rows, m)[0]]) for t, names in PANELS]
    panels = [(t, names) for t, names in panels if names]
    phases = sorted({k for r in rows for k in r if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"})
    if phases:
        panels.append((PHASE_PANEL, phases))
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    fig, axes = plt.subplots((len(panels) + 1) // cols, cols, figsize=(11, 3.2 * ((len(panels) + 1) // cols)),
                             squeeze=False)
    for ax, (panel_title, names) in zip(axes.flat, panels):
        if panel_title == PHASE_PANEL:
            _stack_phases(ax, rows, names)
        else:
            for name in names:
                steps, values = _series(rows, name)
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, label=name)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_step_timeline(trace_file: str, path: str) -> str | None:
    """The last step of the run's timeline (trace.json) as a picture, a lane a process: what each one
    did while the driver ran the step. Returns the step's name, or None without a timeline."""
    if not os.path.isfile(trace_file):
        return None
    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    steps = [e for e in events if e["ph"] == "X" and processes.get(e["pid"]) == "driver"
             and re.fullmatch(r"\S+ step \d+", e["name"])]
    if not steps:
        return None
    step = max(steps, key=lambda e: e["ts"])
    start, end = step["ts"], step["ts"] + step["dur"]
    lanes = sorted({e["pid"] for e in events if e["ph"] == "X" and e["ts"] < end and e["ts"] + e["dur"] > start})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.5 * len(lanes) + 1.2))
    colors: dict[str, str] = {}
    palette = plt.get_cmap("tab20").colors
    shown = [e for e in events if e["ph"] == "X" and e is not step and e["ts"] < end and e["ts"] + e["dur"] > start]
    shown.sort(key=lambda e: e.get("args", {}).get("source") != "ray")  # a call's own spans drawn over it
    for e in shown:
        lane, inside = lanes.index(e["pid"]), e.get("args", {}).get("source") != "ray"
        kind = e["name"].rsplit(": ", 1)[-1]
        color = colors.setdefault(kind, palette[len(colors) % len(palette)])
        x = (max(e["ts"], start) - start) / 1e6
        height = 0.4 if inside and processes.get(e["pid"]) != "driver" else 0.8
        ax.broken_barh([(x, (min(e["ts"] + e["dur"], end) - start) / 1e6 - x)], (lane - height / 2, height),
                       color=color, label=kind if kind not in ax.get_legend_handles_labels()[1] else None)
    ax.set_yticks(range(len(lanes)), [processes.get(pid, str(pid)) for pid in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step")
    ax.set_title(step["name"])
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return step["name"]


def _stack_phases(ax, rows: list[dict], names: list[str]) -> None:
    timed = [r for r in rows if any(n in r for n in names)]
    steps = [r["step"] for r in timed]
    ax.stackplot(steps, [[r.get(n) or 0.0 for r in timed] for n in names],
                 labels=[n.removeprefix("time/").removesuffix("_s") for n in names], alpha=0.8)


def _series(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _last_per_step(rows: list[dict]) -> list[dict]:
    """A resumed run logs again the steps after its checkpoint; keep each step's newest record."""
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def last_samples(run_dir: str) -> list[dict]:
    """The responses samples.jsonl holds for the last step it logged (none without the file)."""
    path = os.path.join(run_dir, SAMPLES_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r["step"] == records[-1]["step"]] if records else []


def _grid(columns: list[str], data: list[list]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_format(cell))}</td>" for cell in row) + "</tr>"
                   for row in data)
    return f"<table><tr>{head}</tr>{rows}</table>"


def _format(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _table(values: dict) -> str:
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_format(v))}</td></tr>"
                   for k, v in values.items())
    return f"<table>{rows}</table>"


def _markdown_table_html(markdown: str) -> str:
    lines = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in markdown.strip().splitlines()]
    return _grid(lines[0], lines[2:])


def _image(png: str) -> str:
    data = base64.b64encode(open(png, "rb").read()).decode()
    return f'<img alt="{html.escape(os.path.basename(png))}" src="data:image/png;base64,{data}">'


def _write_html(path: str, title: str, body: list[str]) -> str:
    style = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;white-space:pre-wrap}img{max-width:100%}")
    with open(path, "w") as f:
        f.write(f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{style}</style>"
                f"</head><body>{''.join(body)}</body></html>\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlsys.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="an rlsys output_dir")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) and not read_summary(run_dir):
            print(f"rlsys report: error: {run_dir} has no metrics.jsonl or summary.json", file=sys.stderr)
            return 2
        print(write_report(run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
