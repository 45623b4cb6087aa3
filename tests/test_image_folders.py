# SPDX-License-Identifier: BSD-3-Clause
"""The image folders as the scripts read them: uint8 images from torchvision's JPEG decoder
or PIL with the pixels PIL gives, one line for a file neither can read, the augmentation on
uint8 tensors, and the normalisation the step does on the XLA device."""

import io
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch_xla
import torchvision
from PIL import Image

import supervisor
import train_single_core
import utils
from conftest import crafted_jpeg, oversized_image

SEED = 7


def photo(mode, rng=None):
  """A smooth 40x30 picture with some noise (JPEG's usual content), in PIL mode `mode`."""
  rng = rng or np.random.default_rng(SEED)
  y, x = np.mgrid[0:30, 0:40]
  rgb = np.stack([x * 6, y * 8, (x + y) * 3], -1) + rng.integers(0, 20, (30, 40, 3))
  return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).convert(mode)


@pytest.mark.parametrize('name, mode, options', [
    ('rgb.jpg', 'RGB', dict(quality=90)),
    ('progressive.jpg', 'RGB', dict(quality=90, progressive=True)),
    ('gray.jpg', 'L', {}),
    ('cmyk.jpg', 'CMYK', {}),
    ('rgba.png', 'RGBA', {}),
    ('palette.png', 'P', {}),
    ('rgb.webp', 'RGB', dict(lossless=True)),
])
def test_every_file_reads_as_the_rgb_pixels_pil_gives(tmp_path, name, mode, options):
  print('seed', SEED)
  path = tmp_path / name
  photo(mode).save(path, **options)
  image = utils.load_image(path)
  assert image.dtype == torch.uint8 and image.shape == (3, 30, 40)
  with Image.open(path) as expected:
    expected = np.asarray(expected.convert('RGB'))
  # libjpeg-turbo in both; a CMYK JPEG's inversion may round one level apart.
  difference = np.abs(image.permute(1, 2, 0).numpy().astype(int) - expected).max()
  assert difference <= (1 if mode == 'CMYK' else 0), difference


def test_an_animated_gif_is_read_as_its_first_frame_and_counted_in_its_class(tmp_path):
  frames = [photo('RGB'), photo('RGB').rotate(180)]
  (tmp_path / 'train' / 'c').mkdir(parents=True)
  frames[0].save(tmp_path / 'train' / 'c' / 'moving.gif', save_all=True, append_images=frames[1:])
  dataset = utils.image_folder(tmp_path, 'train')
  assert [path.rsplit('/', 1)[1] for path, _ in dataset.samples] == ['moving.gif']
  with Image.open(tmp_path / 'train' / 'c' / 'moving.gif') as first:
    assert first.n_frames == 2
    expected = np.asarray(first.convert('RGB'))  # PIL's first frame
  assert np.array_equal(dataset[0][0].permute(1, 2, 0).numpy(), expected)


@pytest.mark.parametrize('name, cut', [('truncated.jpg', 0.5), ('header-only.jpg', 0.02),
                                       ('noise.jpg', None), ('truncated.png', 0.5)])
def test_a_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, name, cut):
  with io.BytesIO() as f:
    photo('RGB').save(f, format='PNG' if name.endswith('png') else 'JPEG')
    data = f.getvalue()
  path = tmp_path / name
  path.write_bytes(data[:max(4, int(len(data) * cut))] if cut else
                   np.random.default_rng(SEED).bytes(3000))
  with pytest.raises(utils.BadDataError) as error:
    utils.load_image(path)
  assert re.fullmatch(rf'cannot read image {re.escape(str(path))} \([^\n]+\): replace or remove '
                      r'the file', str(error.value)), error.value


@pytest.mark.parametrize('kind, side', [('JPEG', 10000), ('JPEG', 30000), ('PNG', 10000),
                                        ('PNG', 30000), ('RST0', 30000), ('TEM', 30000)])
def test_an_image_over_the_pixel_limit_is_one_line_from_its_header(tmp_path, kind, side):
  # Over PIL's Image.MAX_IMAGE_PIXELS (89.5M), and over twice it (where PIL's open refuses it, in
  # words of its own); a JPEG whose walk of markers as libjpeg walks it finds its frame past a
  # smaller one hidden in an APP0 segment (crafted_jpeg).
  path = tmp_path / f'big.{kind.lower()}'
  path.write_bytes(oversized_image(kind, side) if kind in ('JPEG', 'PNG') else
                   crafted_jpeg(b'\xff\xd0' if kind == 'RST0' else b'\xff\x01'))
  with pytest.raises(utils.BadDataError) as error:
    utils.load_image(path)
  assert re.fullmatch(rf'cannot read image {re.escape(str(path))} \({side}x{side} pixels, over '
                      r"the limit of 89,478,485 \(PIL's Image.MAX_IMAGE_PIXELS: raise it to read "
                      r'such images\)\): replace or remove the file', str(error.value)), error.value


@pytest.mark.parametrize('name', ['grey16.png', 'grey16.tif', 'grey16-big-endian.tif'])
def test_16_bit_grey_reads_as_its_values_scaled_to_8_bits(tmp_path, name):
  # PIL's convert('RGB') clips 16-bit values at 255: this image was all but white.
  print('seed', SEED)
  values = np.random.default_rng(SEED).integers(0, 65536, (30, 40)).astype(np.uint16)
  path = tmp_path / name
  if 'big-endian' in name:
    Image.frombytes('I;16B', (40, 30), values.astype('>u2').tobytes()).save(path)
  else:
    Image.fromarray(values).save(path)
  read = utils.load_image(path)
  expected = np.round(values / 257).astype(np.uint8)
  assert read.dtype == torch.uint8 and read.shape == (3, 30, 40)
  assert all(np.array_equal(read[channel].numpy(), expected) for channel in range(3))


@pytest.mark.parametrize('pixels', [np.float32, np.int32])
def test_32_bit_pixels_of_no_known_range_are_one_line_naming_the_file(tmp_path, pixels):
  path = tmp_path / 'depth.tif'
  Image.fromarray((np.arange(1200).reshape(30, 40) * 1000).astype(pixels)).save(path)
  with pytest.raises(utils.BadDataError) as error:
    utils.load_image(path)
  assert re.fullmatch(rf'cannot read image {re.escape(str(path))} \([IF] mode: 32-bit pixels of no '
                      r'known range; save it with 8- or 16-bit pixels\): replace or remove the file',
                      str(error.value)), error.value


def test_folders_give_uint8_crops_seeded_per_sample(tmp_path):
  for split in ('train', 'val'):
    for i in range(3):
      (tmp_path / split / f'c{i}').mkdir(parents=True)
      photo('RGB', np.random.default_rng(i)).save(tmp_path / split / f'c{i}' / f'{i}.jpg')
  train, val, _ = train_single_core.build_datasets(SimpleNamespace(datadir=str(tmp_path), img_dim=24))
  seeded = utils.SeededSamples(train)
  first, label = seeded[(SEED, 1)]
  assert first.dtype == torch.uint8 and first.shape == (3, 24, 24) and label == 1
  assert torch.equal(seeded[(SEED, 1)][0], first)  # the same seed, the same crop and flip
  assert not torch.equal(seeded[(SEED + 1, 1)][0], first)
  # The very crops the scripts drew before the seeding took 1 us instead of 60: fork_rng and
  # torch.manual_seed (a resume of a run saved then sees the same batches); the global RNG is
  # left as it was.
  before = torch.get_rng_state()
  for key in [(SEED, 0), (SEED, 1), (2**63 + 5, 2), (123456789 * 2**32 + 1, 0)]:
    with torch.random.fork_rng(devices=[]):
      torch.manual_seed(key[0])
      former = train[key[1]][0]
    assert torch.equal(seeded[key][0], former), key
  assert torch.equal(torch.get_rng_state(), before)
  image, label = val[2]
  # Evaluation: resized to 27 (256/224 of 24) on the short side, the centre 24x24.
  resized = torchvision.transforms.v2.functional.resize(utils.load_image(
      tmp_path / 'val' / 'c2' / '2.jpg'), 27)
  assert torch.equal(image, torchvision.transforms.v2.functional.center_crop(resized, 24))
  assert supervisor.check_datasets(train, val, 3) == ('Data: 3 training and 3 evaluation samples '
                                                       'of 3x24x24 uint8, 3 classes')


def test_the_step_normalises_uint8_on_the_device_as_torchvision_does_on_the_host():
  rng = np.random.default_rng(SEED)
  images = torch.from_numpy(rng.integers(0, 256, (4, 3, 8, 8), dtype=np.uint8))
  host = torchvision.transforms.Normalize(utils.IMAGENET_MEAN, utils.IMAGENET_STD)(
      images.float() / 255)
  device = utils.normalize(images.to(torch_xla.device())).cpu()
  assert device.dtype == torch.float32
  torch.testing.assert_close(device, host, rtol=0, atol=1e-5)
  cifar = utils.normalize(images.to(torch_xla.device()), (0.4914, 0.4822, 0.4465),
                          (0.2470, 0.2435, 0.2616))  # CIFAR-10's
  assert cifar.cpu()[0, 0, 0, 0] == pytest.approx((images[0, 0, 0, 0] / 255 - 0.4914) / 0.2470)
  # A dataset of floats normalises its own: they reach the model as they are.
  floats = torch.rand(2, 3, 4, 4)
  assert utils.normalize(floats) is floats
