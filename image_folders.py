# SPDX-License-Identifier: BSD-3-Clause
"""ImageNet-style image folders (ROOT/SPLIT/CLASS/*.jpg) for the image-folder scripts and
the shard writer: checked at start, read as uint8 tensors (the loop normalises them on the
device), with one line for a corrupt file."""

import io
import os

import torch
import torchvision
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from utils import BadDataError, UsageError

IMG_EXTENSIONS = torchvision.datasets.folder.IMG_EXTENSIONS


def load_image(path):
  """The image at path as a uint8 RGB tensor (3 x H x W): a JPEG by torchvision's decoder
  (libjpeg-turbo, no PIL image on the way), any other file (PNG, ...) by PIL; a corrupt file
  names itself in one line instead of a traceback."""
  try:
    with open(path, 'rb') as f:
      data = f.read()
    if data[:3] == b'\xff\xd8\xff':
      try:
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                           mode=ImageReadMode.RGB)
      except RuntimeError:
        pass  # PIL reads some that libjpeg refuses here, and says what is wrong with the rest.
    with Image.open(io.BytesIO(data)) as image:
      return v2.functional.pil_to_tensor(image.convert('RGB'))
  except OSError as e:  # PIL.UnidentifiedImageError and truncated files are OSErrors.
    why = 'not an image file' if isinstance(e, Image.UnidentifiedImageError) else e
    raise BadDataError(f'cannot read image {path} ({why}): replace or remove the file') from None


def check(root, splits):
  """ImageFolder datasets of root/SPLIT for each split (no transform), or a UsageError when a
  split is not a folder of class folders of images, or the splits' classes differ."""
  datasets = []
  for folder in (os.path.join(root, split) for split in splits):
    if not os.path.isdir(folder):
      raise UsageError(f'{folder} is not a folder: {root} needs {" and ".join(splits)} with '
                       f'one folder of images per class ({folder}/CLASS/x.jpg)')
    try:
      dataset = torchvision.datasets.ImageFolder(folder, loader=load_image, allow_empty=True)
    except FileNotFoundError:
      raise UsageError(f'{folder} has no class folders: put the images of each class in '
                       f'{folder}/CLASS_NAME/') from None
    empty = sorted(set(dataset.classes) - {dataset.classes[label] for label in dataset.targets})
    if empty:
      raise UsageError(f'class folder {os.path.join(folder, empty[0])} has no images '
                       f'({" ".join(IMG_EXTENSIONS)}): add images or remove the folder')
    if _links(folder):  # ImageFolder follows them: an image must still count once.
      _check_one_path_each(dataset.samples, folder)
    if datasets and dataset.classes != datasets[0].classes:
      raise UsageError(f'{folder} and {os.path.join(root, splits[0])} must hold the same '
                       'class folders')
    datasets.append(dataset)
  return datasets


def _links(folder):
  """The symbolic links below folder, not followed (scandir reads this without a stat)."""
  found, todo = [], [folder]
  while todo:
    with os.scandir(todo.pop()) as entries:
      for entry in entries:
        if entry.is_symlink():
          found.append(entry.path)
        elif entry.is_dir():
          todo.append(entry.path)
  return found


def _check_one_path_each(samples, folder):
  """A UsageError naming the link when a link makes folder reach one image twice (a loop
  such as CLASS/loop -> ., or a link into another class, which mislabels that image)."""
  seen = {}
  for path, _ in samples:
    real = os.path.realpath(path)
    if real in seen:
      link = _link_in(path, folder) or _link_in(seen[real], folder)
      raise UsageError(f'{folder} reaches {real} twice, as {seen[real]} and as {path}, through '
                       f'the symbolic link {link}: remove the link, or keep each image in one '
                       'class folder only')
    seen[real] = path


def _link_in(path, folder):
  """The first symbolic link on the way from folder to path, or None."""
  parts = os.path.relpath(path, folder).split(os.sep)
  return next((link for link in (os.path.join(folder, *parts[:i])
                                 for i in range(1, len(parts) + 1)) if os.path.islink(link)), None)


def load(root, img_dim):
  """(train, val) ImageFolder datasets of root/train and root/val, checked, with the usual
  ImageNet augmentation (train) and centre crop (val) to img_dim x img_dim, on uint8 tensors:
  a quarter of float32's bytes go to the replica and the device, which normalises them."""
  train_set, val_set = check(root, ('train', 'val'))
  # Resize to 256/224 of the crop for evaluation, as torchvision's references do at 224 px.
  train_set.transform = v2.Compose([v2.RandomResizedCrop(img_dim), v2.RandomHorizontalFlip()])
  val_set.transform = v2.Compose([v2.Resize(img_dim * 256 // 224), v2.CenterCrop(img_dim)])
  return train_set, val_set
