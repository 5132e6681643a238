"""Where a run's results go with ``--save-result``: file names, the JSON, CSV and plots of one
run, the files of a sweep and of an SLO search, and the lines printed for those series.

File names: ``--result-filename``'s stem, else ``<backend>-<rate>qps[-concurrency<N>]-<model>-
<date>`` for a run and ``<backend>-<model>-<date>`` for a series; a run or series stopped early
(Ctrl-C, a 4xx) gets ``-interrupted`` added, and its JSON says why in ``config.stopped``.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path
from typing import Any

from loadtest.client import ClientConfig, RunOutput
from loadtest.metrics import Metrics
from loadtest.plots import RunLabel
from loadtest.report import backend, default_filename, result_dict, save_csv, save_json

INTERRUPTED = "-interrupted"


def _ms(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


class Outputs:
    """Saves and labels the results of one invocation (a run, a sweep or a search)."""

    def __init__(
        self,
        args: argparse.Namespace,
        cfg: ClientConfig,
        settings: dict[str, Any],
        slos: dict[str, float],
        ranges: dict[str, tuple[tuple[int, int], tuple[int, int]]],
    ) -> None:
        self.args = args
        self.cfg = cfg
        self.settings = settings
        self.slos = slos
        self.ranges = ranges
        self.started = datetime.now()

    def label(self, rate: str, stopped: str = "") -> RunLabel:
        """The subtitle data of this invocation's figures."""
        return RunLabel(
            model=self.cfg.model,
            endpoint=self.cfg.url,
            dataset=self.args.dataset_name,
            rate=rate,
            date=self.started.strftime("%Y-%m-%d %H:%M"),
            stopped=stopped,
            slos=self.slos,
            ranges=self.ranges,
            chat=self.cfg.chat,
        )

    def _stem(self, default: str, suffix: str, stopped: str) -> Path:
        name = self.args.result_filename or default
        path = Path(self.args.result_dir) / name
        stem = path.with_suffix("") if path.suffix == ".json" else path
        return stem.with_name(stem.name + suffix + (INTERRUPTED if stopped else ""))

    def _series_stem(self, stopped: str) -> Path:
        model = self.cfg.model.split("/")[-1]
        return self._stem(f"{backend(self.cfg)}-{model}-{self.started:%Y%m%d-%H%M%S}", "", stopped)

    def save_run(self, out: RunOutput, m: Metrics, suffix: str = "", plots: bool = True) -> None:
        """The JSON, the CSV and (unless --no-plots) the PNGs of one run, side by side."""
        if not self.args.save_result:
            return
        stem = self._stem(default_filename(self.cfg, out), suffix, out.stopped)
        doc = result_dict(self.cfg, out, m, settings=self.settings)
        written = [save_json(doc, stem.with_name(stem.name + ".json"))]  # keeps dots in names
        written.append(save_csv(out, stem.with_name(stem.name + "_requests.csv"), self.slos))
        if plots and not self.args.no_plots:
            from loadtest.plots import plot_run

            written += plot_run(out, stem, self.label(out.schedule.describe(), out.stopped))
        for path in written:
            print(f"wrote {path}")

    @staticmethod
    def sweep_table(points: list[dict]) -> str:
        """One line per rate of a sweep."""
        lines = [
            f"{'rate':>8}{'req/s':>10}{'tok/s':>10}{'p50 TTFT':>10}{'p50 TPOT':>10}{'attain':>8}"
        ]
        for p in points:
            att = "" if p["slo_attainment"] is None else f"{p['slo_attainment']:.3f}"
            lines.append(
                f"{p['request_rate']!s:>8}{p['request_throughput']:>10.2f}"
                f"{p['output_throughput']:>10.1f}{_ms(p['median_ttft_ms'], '.1f'):>10}"
                f"{_ms(p['median_tpot_ms'], '.2f'):>10}{att:>8}"
            )
        return "\n".join(lines)

    def save_sweep(self, points: list[dict]) -> None:
        """``<stem>_sweep.json`` (every rate's summary) and ``<stem>_sweep.png``."""
        if not self.args.save_result or not points:
            return
        stopped = next((p["config"]["stopped"] for p in points if p["config"]["stopped"]), "")
        stem = self._series_stem(stopped)
        doc = {"runs": points, "config": {**self.settings, "stopped": stopped or None}}
        print(f"wrote {save_json(doc, stem.with_name(stem.name + '_sweep.json'))}")
        if not self.args.no_plots:
            from loadtest.plots import plot_sweep

            first = self.args.metric_percentiles.split(",")[0].strip()
            key = f"p{float(first):g}"
            label = self.label(f"rates {self.args.sweep_rates}", stopped)
            path = plot_sweep(points, stem.with_name(stem.name + "_sweep.png"), label, key)
            print(f"wrote {path}")

    @staticmethod
    def probe_line(probe: Any) -> str:
        """One line per probe of an SLO search."""
        s = probe.summary
        return (
            f"rate {probe.rate:9.3f} req/s  attainment {probe.attainment:.3f}  "
            f"p50 TTFT {_ms(s['median_ttft_ms'], '.1f')} ms  "
            f"p50 TPOT {_ms(s['median_tpot_ms'], '.2f')} ms  failed {s['failed']}"
        )

    def save_search(self, doc: dict[str, Any]) -> None:
        """``<stem>_slo.json``: the rate found and every probe."""
        if self.args.save_result:
            stem = self._series_stem(doc.get("stopped") or "")
            doc = {**doc, "config": self.settings}
            print(f"wrote {save_json(doc, stem.with_name(stem.name + '_slo.json'))}")
