"""The run report without Grafana: tokens/s and step time beside the loss curves, one page that
opens from disk with no network."""

from __future__ import annotations

import base64
import re

import pytest

from crosskd.metrics.report import speed, write_report


def test_speed_is_all_tokens_over_all_step_seconds_with_nearest_rank_percentiles():
    history = [
        {"step": i + 1, "tokens": 100.0, "seconds": s, "ce": 1.0, "kd": 0.5}
        for i, s in enumerate([0.5, 0.1, 0.2, 0.4, 0.3])
    ]
    assert speed(history) == pytest.approx(
        {"tokens_per_s": 500 / 1.5, "step_seconds_p50": 0.3, "step_seconds_p95": 0.5}
    )
    assert speed([{"step": 1, "tokens": 5.0, "ce": 1.0, "kd": 0.0}]) == {}


def test_the_page_shows_speed_and_needs_no_network(tmp_path):
    runs = {
        "kd": [
            {"step": i + 1, "tokens": 64.0, "seconds": 0.25, "ce": 3.0 - i / 10, "kd": 1.0 - i / 20}
            for i in range(4)
        ],
        "ce": [{"step": 1, "tokens": 64.0, "seconds": 0.5, "ce": 3.0, "kd": 0.0}],
    }
    page_uri = write_report(
        str(tmp_path / "report"), {"bits_per_byte": {"student_kd": 2.5}, "runs": runs, "config": {}}
    )
    page = (tmp_path / "report" / "index.html").read_text()
    assert page_uri.endswith("/report/index.html")
    assert "<td>kd</td><td>256.0</td><td>0.250</td><td>0.250</td>" in page
    assert "<td>ce</td><td>128.0</td><td>0.500</td><td>0.500</td>" in page
    images = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert len(images) == 2
    assert all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", page)  # nothing fetched
    assert (tmp_path / "report" / "speed.png").read_bytes()[:4] == b"\x89PNG"


def test_out_of_domain_column_and_the_distilled_student_against_ce_only(tmp_path):
    from crosskd.metrics.report import report_markdown
    from crosskd.steps.evaluate import bits_per_byte_table

    metrics = {
        "bits_per_byte": {
            "teacher": 1.25,
            "student_init": 4.0,
            "student_kd": 3.0,
            "student_ce": 3.5,
        },
        "ood_bits_per_byte": {
            "student_ce": 3.75,
            "teacher": 1.5,
            "student_init": 4.0,
            "student_kd": 3.25,
        },
        "runs": {"kd": [], "ce": []},
        "config": {},
    }
    markdown = report_markdown(metrics)
    assert "| model | in-domain bits/byte | out-of-domain bits/byte |" in markdown
    assert "| student_ce | 3.5000 | 3.7500 |" in markdown
    # 3.25 - 3.75 = -0.5 against CE-only; CE-only 3.75 - 4.0 = -0.25 from the untrained student.
    assert (
        "Out of domain: the distilled student is at 3.2500 bits per byte, -0.5000 against "
        "the CE-only student (3.7500); the untrained student is at 4.0000 (the CE-only "
        "student -0.2500 from it)."
    ) in markdown
    assert "In domain: the distilled student is at 3.0000 bits per byte, -0.5000" in markdown
    write_report(str(tmp_path / "r"), metrics)
    page = (tmp_path / "r" / "index.html").read_text()
    assert "<tr><td>teacher</td><td>1.2500</td><td>1.5000</td></tr>" in page
    assert "<th>out-of-domain bits/byte</th>" in page
    assert bits_per_byte_table(metrics["bits_per_byte"], metrics["ood_bits_per_byte"]) == [
        "held-out bits per byte:",
        "                  in-domain  out-of-domain",
        "  teacher            1.2500         1.5000",
        "  student_init       4.0000         4.0000",
        "  student_kd         3.0000         3.2500",
        "  student_ce         3.5000         3.7500",
    ]
    # Without out-of-domain rows: one column, no comparison without both trained students.
    assert bits_per_byte_table({"student_kd": 3.0, "teacher": 1.0}) == [
        "held-out bits per byte:",
        "  teacher        1.0000",
        "  student_kd     3.0000",
    ]
    plain = report_markdown({"bits_per_byte": {"student_kd": 3.0}, "runs": {}, "config": {}})
    assert "| model | bits/byte |" in plain and "against the CE-only" not in plain


def test_a_run_that_shared_its_machine_is_marked_next_to_its_speed(tmp_path):
    from crosskd.metrics.contention import contention, cpu_share
    from crosskd.metrics.report import report_markdown

    assert cpu_share(1.0, 2.0, threads=1) == 0.5 and cpu_share(4.0, 2.0, threads=2) == 1.0

    def steps(seconds, share=None):
        extra = {} if share is None else {"cpu_share": share}
        return [
            {"step": i + 1, "tokens": 10.0, "seconds": s, "ce": 1.0, "kd": 0.5, **extra}
            for i, s in enumerate(seconds)
        ]

    even = [1.0] * 18
    # the first step (5 s, warm-up) never counts; of the 20 after it, the 95th percentile by
    # nearest rank is the 19th smallest time
    alone = steps([5.0, *even, 1.2, 1.4], share=0.95)
    assert contention(alone) == []
    crowded = steps([5.0, *even, 3.0, 3.0], share=0.45)
    assert contention(crowded) == [
        "median CPU share 0.45 of its threads (alone: about 1)",
        "step time p95 3.0x its median",
    ]
    on_gpu = steps([5.0, *even, 1.0, 3.0])  # no CPU share: only the spread counts
    assert contention(on_gpu) == []
    assert contention(steps([5.0, *even, 2.0, 2.0])) == ["step time p95 2.0x its median"]
    assert contention(steps([5.0, *[1.0] * 5, 3.0])) == []  # too few steps for a spread
    assert contention(steps([1.0])) is None and contention([]) is None
    metrics = {
        "bits_per_byte": {"student_kd": 2.0},
        "runs": {"kd": alone, "ce": crowded, "one": steps([1.0])},
    }
    write_report(str(tmp_path / "r"), {**metrics, "config": {}})
    page = (tmp_path / "r" / "index.html").read_text()
    # 210 tokens over 25.6 s; of all 21 steps the median is 1.0 s and the 20th smallest 1.4 s
    assert "<td>kd</td><td>8.2</td><td>1.000</td><td>1.400</td><td>no</td>" in page
    assert (
        "<td>ce</td><td>7.2</td><td>1.000</td><td>3.000</td><td>yes: median CPU share 0.45 of "
        "its threads (alone: about 1); step time p95 3.0x its median</td>"
    ) in page
    assert "<td>one</td><td>10.0</td><td>1.000</td><td>1.000</td><td>unknown" in page
    assert "its speed is not the method&#x27;s cost" in page
    markdown = report_markdown({**metrics, "config": {}})
    assert "Run `ce`: 21 steps, last CE 1.0000, KD 0.5000; shared the machine: yes:" in markdown


def test_the_threads_a_step_can_use_count_the_container_cpu_quota(tmp_path):
    import os

    import torch

    from crosskd.metrics.contention import usable_threads

    cores = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    before = torch.get_num_threads()
    torch.set_num_threads(64)
    try:
        for text, limit in (("max 100000\n", cores), ("150000 100000\n", 2), ("50000 100000", 1)):
            cpu_max.write_text(text)
            assert usable_threads(cpu_max) == min(cores, limit)
        assert usable_threads(tmp_path / "absent") == cores
    finally:
        torch.set_num_threads(before)
