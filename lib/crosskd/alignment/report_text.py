"""The text form of the pair compatibility report (:mod:`crosskd.alignment.report`)."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from crosskd.alignment.report import WORKABLE_SHARE, ratio

if TYPE_CHECKING:
    from crosskd.alignment.report import PairReport


def format_report(r: PairReport) -> str:
    """The text form of a pair report (see :meth:`PairReport.format`)."""
    shares = r.signal_shares
    one_n, n_one, n_m = r.shapes["1:n"], r.shapes["n:1"], r.shapes["n:m"]
    lines = [
        f"Tokenizer pair report: student {r.student}  vs  teacher {r.teacher}",
        "=" * 78,
        f"Verdict: {r.verdict}",
        "",
        "Corpus",
        f"  documents        {r.documents:>12,}",
        f"  characters       {r.characters:>12,}",
        f"  student tokens   {r.student_tokens:>12,}   {r.student_tokens_per_char:.3f} per char",
        f"  teacher tokens   {r.teacher_tokens:>12,}   {r.teacher_tokens_per_char:.3f} per char",
        "",
        "KD signal (share of student tokens)",
        f"  token-to-token        (correct 1:1)          {shares['token']:>7.2%}",
        f"  chunk + alternatives  (correct 1:n, n:1)     {shares['chunk']:>7.2%}",
        f"  realized text only    (correct n:m, special) {shares['realized']:>7.2%}",
        f"  none                  (incorrect, unpaired)  {shares['none']:>7.2%}",
        f"  in 1:1 chunks: {r.one_to_one_student_share:.2%} of student tokens, "
        f"{r.one_to_one_teacher_share:.2%} of teacher tokens",
        "",
        "Chunk shapes",
        f"  {'shape':<8}{'chunks':>10}{'%':>8}{'student tok':>13}{'%':>8}{'teacher tok':>13}"
        f"{'%':>8}{'correct':>9}",
    ]
    for name, st in [*r.shapes.items(), ("all", None)]:
        chunks, s_tok, t_tok, correct = (
            (st.chunks, st.student_tokens, st.teacher_tokens, st.correct_rate)
            if st is not None
            else (
                r.chunks,
                r.student_tokens - r.unpaired_student_tokens,
                r.teacher_tokens - r.unpaired_teacher_tokens,
                r.correct_rate,
            )
        )
        lines.append(
            f"  {name:<8}{chunks:>10,}{ratio(chunks, r.chunks):>8.1%}"
            f"{s_tok:>13,}{ratio(s_tok, r.student_tokens):>8.1%}"
            f"{t_tok:>13,}{ratio(t_tok, r.teacher_tokens):>8.1%}"
            + (f"{correct:>9.2%}" if chunks else f"{'-':>9}")
        )
    lines += [
        "",
        "Chunk sizes (tokens per chunk: mean, max)",
        f"  1:n  teacher  {ratio(one_n.teacher_tokens, one_n.chunks):.2f}, "
        f"{one_n.max_teacher_tokens}",
        f"  n:1  student  {ratio(n_one.student_tokens, n_one.chunks):.2f}, "
        f"{n_one.max_student_tokens}",
        f"  n:m  student  {ratio(n_m.student_tokens, n_m.chunks):.2f}, {n_m.max_student_tokens}"
        f";  teacher {ratio(n_m.teacher_tokens, n_m.chunks):.2f}, {n_m.max_teacher_tokens}",
        "",
        "Correctness",
        f"  correct chunks                      {r.correct_rate:.2%}",
        f"  student tokens in incorrect chunks  {r.incorrect_student_share:.2%}",
        f"  unpaired tokens                     student {r.unpaired_student_tokens:,}, "
        f"teacher {r.unpaired_teacher_tokens:,} (in {r.documents_with_unpaired:,} documents)",
        f"  chunks without a prediction         {r.chunks_without_prediction:,} "
        f"(a document's first chunk)",
        "",
        "Common vocabulary (one-to-one common tokens)",
        f"  common tokens   {r.common_vocabulary:,}",
        f"  of vocabularies {r.common_student_share:.2%} of the student's "
        f"{r.student_vocabulary:,}, {r.common_teacher_share:.2%} of the teacher's "
        f"{r.teacher_vocabulary:,}",
        f"  in this text    {ratio(r.student_tokens_common, r.student_tokens):.2%} of student "
        f"tokens, {ratio(r.teacher_tokens_common, r.teacher_tokens):.2%} of teacher tokens",
        "",
        "What this means",
    ]
    meaning = (
        f"In 1:1 chunks ({shares['token']:.1%} of student tokens) the KD loss compares the two "
        f"next-token distributions over the {r.common_vocabulary:,} common tokens (those in "
        f"the teacher's top K) plus the realized token: the richest signal. In 1:n and n:1 "
        f"chunks ({shares['chunk']:.1%}) it compares the realized text with alternatives that "
        f"leave the realized path at one token; in n:m chunks and special pairs "
        f"({shares['realized']:.1%}) only the realized text against everything else, one "
        f"binary comparison. Incorrect chunks and unpaired tokens ({shares['none']:.1%}) get "
        f"no KD signal. Between teachers of similar quality, prefer the one with the higher "
        f"token-to-token share and the larger common vocabulary on text like your training "
        f"data; below {WORKABLE_SHARE:.0%} token-to-token, most of what the teacher knows "
        f"reaches the student only as chunk-level probabilities."
    )
    lines += textwrap.wrap(
        meaning, 78, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False
    )
    return "\n".join(lines)
