# SPDX-License-Identifier: BSD-3-Clause
"""ImageNet-style image folders (ROOT/SPLIT/CLASS/*.jpg) for the image-folder scripts and
the shard writer: checked at start, read with one line for a corrupt file."""

import os

import torchvision
from PIL import Image

from utils import BadDataError, UsageError

IMG_EXTENSIONS = torchvision.datasets.folder.IMG_EXTENSIONS
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as torchvision uses


def load_image(path):
  """ImageFolder's loader, but a corrupt file names itself instead of a PIL traceback."""
  try:
    with open(path, 'rb') as f:
      return Image.open(f).convert('RGB')
  except OSError as e:  # PIL.UnidentifiedImageError and truncated files are OSErrors.
    raise BadDataError(f'cannot read image {path} ({e}): replace or remove the file') from None


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
  ImageNet augmentation (train) and centre crop (val) to img_dim x img_dim."""
  T = torchvision.transforms
  train_set, val_set = check(root, ('train', 'val'))
  # Resize to 256/224 of the crop for evaluation, as torchvision's references do at 224 px.
  train_set.transform = T.Compose([T.RandomResizedCrop(img_dim), T.RandomHorizontalFlip(),
                                   T.ToTensor(), T.Normalize(MEAN, STD)])
  val_set.transform = T.Compose([T.Resize(img_dim * 256 // 224), T.CenterCrop(img_dim),
                                 T.ToTensor(), T.Normalize(MEAN, STD)])
  return train_set, val_set
