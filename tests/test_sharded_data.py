"""What a learner sharded with `to_fsdp` trains on and what `get_preds` returns, as the Sharded training page says: fastai's
`DistributedDL` gives each of the 2 ranks a contiguous half of the data in batches of `bs` (one step: 2×`bs` samples), and
`get_preds` returns the ranks' batches interleaved, not in the dataset's order, each prediction paired with its input and
target. 2 CPU processes with gloo run tests/order_worker.py; if fastai changes this, the page must change with it."""
import json
import pytest
from torchrun import launch

ORDER = [0, 1, 2, 3, 10, 11, 12, 13, 4, 5, 6, 7, 14, 15, 16, 17, 8, 9, 18, 19]  # the page's example: 20 samples, bs=4

@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    out = tmp_path_factory.mktemp('sharded_data')
    launch('order_worker.py', out, timeout=300)
    return [json.loads((out/f'rank{r}.json').read_text()) for r in (0, 1)]

def test_each_rank_trains_on_its_half(ranks):
    "Rank 0 trains on the first half of the samples, rank 1 on the second, each in batches of `bs` (the last partial one dropped)."
    assert [r['train'] for r in ranks] == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[10, 11, 12, 13], [14, 15, 16, 17]]]

def test_get_preds_order(ranks):
    "Every rank gets every prediction, batch by batch from each rank in turn; inputs and targets in the same order."
    for r in ranks:
        assert r['n_preds'] == 20 and r['targets'] == ORDER and r['inputs'] == ORDER, r
