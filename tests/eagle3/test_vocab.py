"""Draft vocabulary: d2t offsets and t2d membership (docs/design/eagle3-head.md, "d2t semantics")."""

import json

import pytest
import torch

from tsengine.eagle3.vocab import read_token_counts, vocab_map
from tsengine.errors import UserError


def test_without_counts_the_first_n_ids():
    d2t, t2d = vocab_map(10, 4)
    assert d2t.tolist() == [0, 0, 0, 0]
    assert t2d.tolist() == [True] * 4 + [False] * 6


def test_most_frequent_ids_ascending_with_offsets():
    counts = torch.tensor([0, 5, 0, 9, 1, 9, 0, 0.0])
    d2t, t2d = vocab_map(8, 3, counts)
    target = (torch.arange(3) + d2t).tolist()
    assert target == [1, 3, 5]  # top 3 by count, listed in ascending target id
    assert d2t.dtype == torch.int64 and (d2t >= 0).all()
    assert t2d.nonzero().flatten().tolist() == [1, 3, 5]


def test_ties_go_to_lower_ids_and_unseen_ids_pad():
    counts = torch.tensor([0, 2, 2, 2, 0, 0.0])
    d2t, _ = vocab_map(6, 2, counts)
    assert (torch.arange(2) + d2t).tolist() == [1, 2]
    d2t, t2d = vocab_map(6, 5, counts)  # only 3 seen: pad with the lowest unseen ids
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 3, 4]
    assert int(t2d.sum()) == 5


def test_size_out_of_range():
    with pytest.raises(UserError, match="draft vocab size 11 must be in 1..10"):
        vocab_map(10, 11)


def test_counts_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"3": 7, "1": 2}))
    assert read_token_counts(p, 5).tolist() == [0, 2, 0, 7, 0]
    p.write_text(json.dumps({"9": 1}))
    with pytest.raises(UserError, match="token id 9 is outside 0..4"):
        read_token_counts(p, 5)
    p.write_text("{nope")
    with pytest.raises(UserError, match="cannot read JSON"):
        read_token_counts(p, 5)
