# SPDX-License-Identifier: BSD-3-Clause
"""How work is split across replicas, for world sizes a CPU cannot run (up to a 64-chip pod).

XLA:CPU runs collectives on one device only, so the code that depends on (rank,
world_size) is written as functions of them and checked here for every world size.
"""

import itertools

import pytest
import torch

import utils

WORLD_SIZES = list(range(1, 65))
SIZES = [1, 7, 64, 100, 1000, 1281]  # Some divide by many world sizes, some by none.


class Indexed(torch.utils.data.Dataset):

  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return i


def epoch_indices(n, world_size, seed, epoch, batch_size=1):
  shares = []
  for rank in range(world_size):
    sampler = utils.EpochSampler(Indexed(n), rank, world_size, seed, batch_size)
    sampler.set_epoch(epoch)
    shares.append([index for _, index in sampler])
  return shares


@pytest.mark.parametrize('n', SIZES)
def test_training_samples_go_to_one_replica_and_steps_are_equal(n):
  for world_size, batch_size in itertools.product(WORLD_SIZES, [1, 3, 8]):
    shares = epoch_indices(n, world_size, seed=0, epoch=1, batch_size=batch_size)
    seen = [i for share in shares for i in share]
    assert len(seen) == len(set(seen)), (world_size, 'a sample went to two replicas')
    assert set(seen) <= set(range(n))
    assert len(seen) == n - n % world_size  # Only the remainder below world_size is left out.
    # A DataLoader over each share gives every replica the same steps, whole or not.
    assert len({len(share) // batch_size for share in shares}) == 1
    assert len({-(-len(share) // batch_size) for share in shares}) == 1


def test_training_order_changes_by_epoch_and_by_seed():
  for world_size in [1, 2, 3, 8, 64]:
    first = epoch_indices(1000, world_size, seed=5, epoch=1)
    assert epoch_indices(1000, world_size, seed=5, epoch=2) != first
    assert epoch_indices(1000, world_size, seed=6, epoch=1) != first


def test_resumed_epoch_skips_exactly_the_trained_batches_with_the_same_seeds():
  for world_size, rank, batch_size in [(1, 0, 1), (8, 5, 4), (64, 63, 3)]:
    sampler = utils.EpochSampler(Indexed(5000), rank, world_size, 3, batch_size)
    sampler.set_epoch(4)
    whole = list(sampler)
    steps = len(whole) // batch_size
    for first_batch in [0, 1, 8, steps - 1, steps]:
      sampler.set_epoch(4, first_batch)
      assert len(sampler) == len(whole) - first_batch * batch_size
      assert list(sampler) == whole[first_batch * batch_size:]
  # Seeds differ by sample and by epoch: every crop is drawn anew.
  seeds = set()
  for epoch in range(1, 4):
    sampler = utils.EpochSampler(Indexed(5000), 0, 1, 3, 1)
    sampler.set_epoch(epoch)
    seeds |= {seed for seed, _ in sampler}
  assert len(seeds) == 3 * 5000


class Labelled(torch.utils.data.Dataset):
  """Sample i is (an image, label i): evaluation counts samples by their label, padding is -1."""
  IMAGE = torch.zeros(1)

  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return self.IMAGE, i


@pytest.mark.parametrize('n', SIZES + [50000])
def test_every_validation_image_is_evaluated_once_with_equal_steps(n):
  for world_size, batch_size in itertools.product(WORLD_SIZES, [1, 4, 64]):
    shares = [[label for _, label in utils.eval_share(Labelled(n), rank, world_size, batch_size)]
              for rank in range(world_size)]
    real = [i for share in shares for i in share if i >= 0]
    assert sorted(real) == list(range(n))
    lengths = {len(share) for share in shares}
    assert len(lengths) == 1 and lengths.pop() % batch_size == 0  # Same steps, whole batches.
    assert all(i == -1 for share in shares for i in share if i < 0)
    # Padding is less than one batch per replica beyond the largest share.
    assert len(shares[0]) < -(-n // world_size) + batch_size


def test_padding_samples_are_blank_with_label_minus_one_and_shaped_like_the_data():
  images = [(torch.full((1, 3, 2), float(i + 1)), i % 3) for i in range(5)]
  padded = utils.eval_share(images, 1, 2, 4)
  assert [label for _, label in padded] == [1, 0, -1, -1]
  assert torch.equal(padded[2][0], torch.zeros(1, 3, 2))


def test_warmup_then_step_decay():
  # 100 steps an epoch, 2 warm-up epochs, divide by 5 every 3 epochs.
  lr = lambda step: 0.5 * utils.warmup_step_decay(step, 100, 2, 3, 5)
  assert lr(0) == pytest.approx(0.5 / 200)
  assert lr(99) == pytest.approx(0.25)
  assert lr(199) == pytest.approx(0.5)  # Last warm-up step reaches the peak.
  assert lr(200) == pytest.approx(0.5)
  assert lr(299) == pytest.approx(0.5)
  assert lr(300) == pytest.approx(0.1)  # Epoch 3 starts: first division.
  assert lr(599) == pytest.approx(0.1)
  assert lr(600) == pytest.approx(0.02)
  assert lr(900) == pytest.approx(0.004)
  # No warm-up: the peak from step 0. Fractional warm-up epochs count in steps.
  assert utils.warmup_step_decay(0, 100, 0, 3, 5) == 1.0
  assert utils.warmup_step_decay(44, 100, 0.9, 20, 5) == pytest.approx(45 / 90)
  assert utils.warmup_step_decay(90, 100, 0.9, 20, 5) == 1.0
