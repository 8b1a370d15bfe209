"""The run report without Grafana: tokens/s and step time beside the loss curves, one page that
opens from disk with no network."""

from __future__ import annotations

import base64
import re

import pytest

from crosskd.metrics.report import speed, write_report


def test_speed_is_all_tokens_over_all_step_seconds_with_nearest_rank_percentiles():
    history = [{"step": i + 1, "tokens": 100.0, "seconds": s, "ce": 1.0, "kd": 0.5}
               for i, s in enumerate([0.5, 0.1, 0.2, 0.4, 0.3])]  # fmt: skip
    assert speed(history) == pytest.approx(
        {"tokens_per_s": 500 / 1.5, "step_seconds_p50": 0.3, "step_seconds_p95": 0.5})
    assert speed([{"step": 1, "tokens": 5.0, "ce": 1.0, "kd": 0.0}]) == {}


def test_the_page_shows_speed_and_needs_no_network(tmp_path):
    runs = {"kd": [{"step": i + 1, "tokens": 64.0, "seconds": 0.25, "ce": 3.0 - i / 10,
                    "kd": 1.0 - i / 20} for i in range(4)],
            "ce": [{"step": 1, "tokens": 64.0, "seconds": 0.5, "ce": 3.0, "kd": 0.0}]}  # fmt: skip
    page_uri = write_report(str(tmp_path / "report"),
                            {"bits_per_byte": {"student_kd": 2.5}, "runs": runs, "config": {}})
    page = (tmp_path / "report" / "index.html").read_text()
    assert page_uri.endswith("/report/index.html")
    assert "<td>kd</td><td>256.0</td><td>0.250</td><td>0.250</td>" in page
    assert "<td>ce</td><td>128.0</td><td>0.500</td><td>0.500</td>" in page
    images = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert len(images) == 2
    assert all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", page)  # nothing fetched
    assert (tmp_path / "report" / "speed.png").read_bytes()[:4] == b"\x89PNG"
