"""ImageNet-style image folders (ROOT/SPLIT/CLASS/*.jpg) for the image-folder scripts and
the shard writer: checked at start, read with one line for a corrupt file."""

import os

import torchvision
from PIL import Image

from utils import BadDataError, UsageError

IMG_EXTENSIONS = torchvision.datasets.folder.IMG_EXTENSIONS


def load_image(path):
  """ImageFolder's loader, but a corrupt file names itself instead of a PIL traceback."""
  try:
    with open(path, 'rb') as f:
      return Image.open(f).convert('RGB')
  except OSError as e:  # PIL.UnidentifiedImageError and truncated files are OSErrors.
    raise BadDataError(f'cannot read image {path} ({e}): replace or remove the file') from None


def check(root, splits):
  """The class names of root/SPLIT/CLASS/*.jpg, the same in every split, or a UsageError.
  Prints what ImageFolder will find, so that a folder that is not what one thinks shows."""
  found = None
  for folder in (os.path.join(root, split) for split in splits):
    if not os.path.isdir(folder):
      raise UsageError(f'{folder} is not a folder: {root} needs {" and ".join(splits)} with '
                       f'one folder of images per class ({folder}/CLASS/x.jpg)')
    try:
      classes, class_to_idx = torchvision.datasets.folder.find_classes(folder)
    except FileNotFoundError:
      raise UsageError(f'{folder} has no class folders: put the images of each class in '
                       f'{folder}/CLASS_NAME/') from None
    images = torchvision.datasets.folder.make_dataset(folder, class_to_idx, IMG_EXTENSIONS,
                                                      allow_empty=True)
    empty = sorted(set(classes) - {classes[label] for _, label in images})
    if empty:
      raise UsageError(f'class folder {os.path.join(folder, empty[0])} has no images '
                       f'({" ".join(IMG_EXTENSIONS)}): add images or remove the folder')
    if found is not None and classes != found:
      raise UsageError(f'{folder} and {os.path.join(root, splits[0])} must hold the same '
                       'class folders')
    found = classes
    print(f'{folder}: {len(images):,} images in {len(classes)} classes', flush=True)
  return found


def load(root, img_dim, train):
  """An ImageFolder split with the usual ImageNet augmentation (train) or centre crop (val)."""
  T = torchvision.transforms
  if train:
    transform = [T.RandomResizedCrop(img_dim), T.RandomHorizontalFlip()]
  else:  # Resize to 256/224 of the crop, as torchvision's references do at 224 px.
    transform = [T.Resize(img_dim * 256 // 224), T.CenterCrop(img_dim)]
  transform += [T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
  return torchvision.datasets.ImageFolder(root, T.Compose(transform), loader=load_image)
