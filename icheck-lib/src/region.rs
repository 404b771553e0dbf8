//! Checkpointed memory: typed regions the application shares with the
//! library, and the element types the library understands.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use icheck_core::protocol::DataKind;

mod sealed {
    pub trait Sealed {}
}

/// Element types a label may hold: plain numbers without padding or
/// invalid bit patterns, so their bytes can be copied and restored as is.
pub trait Element: Copy + Default + Send + Sync + 'static + sealed::Sealed {
    /// The kind recorded in the manifest.
    const KIND: DataKind;
}

macro_rules! element {
    ($($t:ty => $kind:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const KIND: DataKind = DataKind::$kind;
        }
    )*};
}
element!(u8 => Char, i32 => Int, i64 => Long, f32 => Float, f64 => Double);

/// Memory the application checkpoints: a vector of `T` shared between the
/// application and the library. The application reads and writes it through
/// [`read`](Region::read) and [`write`](Region::write); the library holds a
/// read lock while a commit copies or transfers it, so the bytes of a
/// version are never torn.
pub struct Region<T: Element> {
    data: Arc<RwLock<Vec<T>>>,
}

impl<T: Element> Clone for Region<T> {
    fn clone(&self) -> Self {
        Region { data: self.data.clone() }
    }
}

impl<T: Element> Region<T> {
    /// A region of `len` default (zero) elements.
    pub fn zeroed(len: usize) -> Region<T> {
        Region::from_vec(vec![T::default(); len])
    }

    /// A region holding `data`.
    pub fn from_vec(data: Vec<T>) -> Region<T> {
        Region { data: Arc::new(RwLock::new(data)) }
    }

    /// Shared access to the elements.
    pub fn read(&self) -> RwLockReadGuard<'_, Vec<T>> {
        self.data.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Exclusive access (resizing is allowed: the next commit uses the new size).
    pub fn write(&self) -> RwLockWriteGuard<'_, Vec<T>> {
        self.data.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bytes of a region, locked for reading.
pub(crate) type ReadBytes<'a> = Box<dyn std::ops::Deref<Target = [u8]> + 'a>;
/// Bytes of a region, locked for writing.
pub(crate) type WriteBytes<'a> = Box<dyn std::ops::DerefMut<Target = [u8]> + 'a>;

/// The library's type-erased view of an added region.
pub(crate) trait Source: Send + Sync {
    /// Element kind.
    fn kind(&self) -> DataKind;
    /// The bytes, locked for reading until the box is dropped.
    fn bytes(&self) -> ReadBytes<'_>;
    /// The bytes, locked for writing until the box is dropped.
    fn bytes_mut(&self) -> WriteBytes<'_>;
}

fn as_bytes<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: Element types are plain numbers without padding; any of their
    // bytes may be read, and the length covers exactly the slice.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), std::mem::size_of_val(data)) }
}

/// Views a slice of elements as bytes, mutably.
pub(crate) fn as_bytes_mut<T: Element>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: as in as_bytes; in addition every bit pattern is a valid value
    // of an Element type, so arbitrary bytes may be written.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), std::mem::size_of_val(data)) }
}

struct ReadGuard<'a, T: Element>(RwLockReadGuard<'a, Vec<T>>);
impl<T: Element> std::ops::Deref for ReadGuard<'_, T> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        as_bytes(&self.0)
    }
}

struct WriteGuard<'a, T: Element>(RwLockWriteGuard<'a, Vec<T>>);
impl<T: Element> std::ops::Deref for WriteGuard<'_, T> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        as_bytes(&self.0)
    }
}
impl<T: Element> std::ops::DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut [u8] {
        as_bytes_mut(&mut self.0)
    }
}

impl<T: Element> Source for Region<T> {
    fn kind(&self) -> DataKind {
        T::KIND
    }
    fn bytes(&self) -> ReadBytes<'_> {
        Box::new(ReadGuard(self.read()))
    }
    fn bytes_mut(&self) -> WriteBytes<'_> {
        Box::new(WriteGuard(self.write()))
    }
}

/// Memory the application owns and promises to keep valid (the C ABI's
/// regions); see [`Icheck::add_raw`](crate::Icheck::add_raw).
pub(crate) struct RawSource {
    pub ptr: *mut u8,
    pub len: usize,
    pub kind: DataKind,
}

// SAFETY: the caller of the unsafe `add_raw` promises the memory stays valid
// and is not accessed concurrently with library calls.
unsafe impl Send for RawSource {}
// SAFETY: see Send.
unsafe impl Sync for RawSource {}

struct RawBytes<'a>(&'a RawSource);
impl std::ops::Deref for RawBytes<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: add_raw's contract: ptr is valid for len bytes while added.
        unsafe { std::slice::from_raw_parts(self.0.ptr, self.0.len) }
    }
}
impl std::ops::DerefMut for RawBytes<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and no one else uses the memory during the
        // library call that asked for it.
        unsafe { std::slice::from_raw_parts_mut(self.0.ptr, self.0.len) }
    }
}

impl Source for RawSource {
    fn kind(&self) -> DataKind {
        self.kind
    }
    fn bytes(&self) -> ReadBytes<'_> {
        Box::new(RawBytes(self))
    }
    fn bytes_mut(&self) -> WriteBytes<'_> {
        Box::new(RawBytes(self))
    }
}
