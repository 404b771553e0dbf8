! icheck: Fortran 2008 module over the C API (include/icheck.h).
!
! The calls mirror the C API: integer functions returning ICHECK_SUCCESS (0)
! or a negative ICHECK_ERR_* code. The communicator is the usual integer
! handle (e.g. MPI_COMM_WORLD from `use mpi`). Arrays are passed as they are
! (contiguous); the element count and type are given as in C.
!
!   use icheck
!   ierr = icheck_init("", "heat2d", MPI_COMM_WORLD, status)   ! "" = $ICHECK_CONFIG
!   ierr = icheck_add("grid", grid, size(grid, kind=c_size_t), ICHECK_DOUBLE)
!   ierr = icheck_commit()
module icheck
  use, intrinsic :: iso_c_binding
  implicit none
  private

  integer(c_int), parameter, public :: ICHECK_SUCCESS = 0
  integer(c_int), parameter, public :: ICHECK_ERR_NULL = -1, ICHECK_ERR_ORDER = -2, ICHECK_ERR_ARG = -3
  integer(c_int), parameter, public :: ICHECK_ERR_CONFIG = -4, ICHECK_ERR_CONTROLLER = -5, ICHECK_ERR_AGENT = -6
  integer(c_int), parameter, public :: ICHECK_ERR_FABRIC = -7, ICHECK_ERR_LABEL = -8, ICHECK_ERR_SIZE = -9
  integer(c_int), parameter, public :: ICHECK_ERR_TYPE = -10, ICHECK_ERR_NO_CHECKPOINT = -11
  integer(c_int), parameter, public :: ICHECK_ERR_CORRUPT = -12, ICHECK_ERR_INCOMPLETE = -13
  integer(c_int), parameter, public :: ICHECK_ERR_RANKS = -14, ICHECK_ERR_UNSUPPORTED = -15
  integer(c_int), parameter, public :: ICHECK_ERR_INTERNAL = -16, ICHECK_ERR_ADAPT = -17
  integer(c_int), parameter, public :: ICHECK_ERR_ACCESS = -18
  integer(c_int), parameter, public :: ICHECK_CHAR = 1, ICHECK_INT = 2, ICHECK_LONG = 3
  integer(c_int), parameter, public :: ICHECK_FLOAT = 4, ICHECK_DOUBLE = 5, ICHECK_BINARY = 6
  ! Fortran names are case-insensitive, so the C constant ICHECK_RESTART would
  ! clash with the function icheck_restart: here it is ICHECK_RESTARTING.
  integer(c_int), parameter, public :: ICHECK_FRESH = 0, ICHECK_RESTARTING = 1
  integer(c_int), parameter, public :: IC_CLEANUP = 0, IC_PERSIST = 1
  ! Malleability (see icheck.h): attributes of replicated data ...
  integer(c_int), parameter, public :: ICHECK_CONSTANT = 1, ICHECK_SIZE = 2, ICHECK_RANK = 3
  integer(c_int), parameter, public :: ICHECK_DEFAULT = 4, ICHECK_DEFAULT_JOINING = 5, ICHECK_VOLATILE = 6
  ! ... and distributions of 1-D arrays.
  integer(c_int), parameter, public :: ICHECK_BLOCK = 1, ICHECK_CYCLIC = 2, ICHECK_PREDEFINED = 3
  integer(c_int), parameter, public :: ICHECK_MANUAL = 4

  public :: icheck_init, icheck_add, icheck_commit, icheck_enable_asynchronous, icheck_wait
  public :: icheck_restart, icheck_restore, icheck_restart_all, icheck_probe_agents
  public :: icheck_finalize, icheck_strerror, icheck_protected_version, icheck_wait_protected
  public :: icheck_add_adapt, icheck_add_adapt_default, icheck_add_adapt_volatile
  public :: icheck_pmap_create, icheck_add_processor_mapping, icheck_pmap_free
  public :: icheck_add_adapt_global, icheck_local_count, icheck_redistribute

  interface
    integer(c_int) function c_init(config, app, fcomm, status) bind(C, name="icheck_init_f")
      import :: c_int, c_ptr, c_char
      type(c_ptr), value :: config
      character(kind=c_char), dimension(*), intent(in) :: app
      integer(c_int), value :: fcomm
      integer(c_int), intent(out) :: status
    end function
    integer(c_int) function c_add(label, data, count, type) bind(C, name="icheck_add")
      import :: c_int, c_ptr, c_char, c_size_t
      character(kind=c_char), dimension(*), intent(in) :: label
      type(c_ptr), value :: data
      integer(c_size_t), value :: count
      integer(c_int), value :: type
    end function
    integer(c_int) function icheck_commit() bind(C, name="icheck_commit")
      import :: c_int
    end function
    integer(c_int) function icheck_enable_asynchronous(flag) bind(C, name="icheck_enable_asynchronous")
      import :: c_int
      integer(c_int), value :: flag
    end function
    integer(c_int) function icheck_wait() bind(C, name="icheck_wait")
      import :: c_int
    end function
    integer(c_int) function icheck_restart() bind(C, name="icheck_restart")
      import :: c_int
    end function
    integer(c_int) function c_restore(label, data, count) bind(C, name="icheck_restore")
      import :: c_int, c_ptr, c_char, c_size_t
      character(kind=c_char), dimension(*), intent(in) :: label
      type(c_ptr), value :: data
      integer(c_size_t), value :: count
    end function
    integer(c_int) function icheck_restart_all() bind(C, name="icheck_restart_all")
      import :: c_int
    end function
    integer(c_int) function c_probe(hints) bind(C, name="icheck_probe_agents")
      import :: c_int, c_ptr
      type(c_ptr), value :: hints
    end function
    ! Collective: the newest version whose redundancy on other checkpoint
    ! nodes is in place (0: none yet).
    integer(c_int) function icheck_protected_version(version) bind(C, name="icheck_protected_version")
      import :: c_int, c_int64_t
      integer(c_int64_t), intent(out) :: version
    end function
    ! Collective: waits until version (or a newer one) is protected.
    integer(c_int) function icheck_wait_protected(version, timeout_secs) bind(C, name="icheck_wait_protected")
      import :: c_int, c_int64_t, c_double
      integer(c_int64_t), value :: version
      real(c_double), value :: timeout_secs
    end function
    integer(c_int) function icheck_finalize(mode) bind(C, name="icheck_finalize")
      import :: c_int
      integer(c_int), value :: mode
    end function
    type(c_ptr) function c_strerror(code) bind(C, name="icheck_strerror")
      import :: c_int, c_ptr
      integer(c_int), value :: code
    end function
    integer(c_int) function c_add_adapt(label, data, count, type, attribute, default_value, recalc, arg) &
        bind(C, name="icheck_add_adapt")
      import :: c_int, c_ptr, c_char, c_size_t, c_funptr
      character(kind=c_char), dimension(*), intent(in) :: label
      type(c_ptr), value :: data
      integer(c_size_t), value :: count
      integer(c_int), value :: type, attribute
      type(c_ptr), value :: default_value
      type(c_funptr), value :: recalc
      type(c_ptr), value :: arg
    end function
    ! rows x cols array; returns a handle (c_null_ptr on bad sizes).
    type(c_ptr) function icheck_pmap_create(rows, cols) bind(C, name="icheck_pmap_create")
      import :: c_ptr, c_int64_t
      integer(c_int64_t), value :: rows, cols
    end function
    integer(c_int) function icheck_add_processor_mapping(num_procs, dims, global_count, pmap) &
        bind(C, name="icheck_add_processor_mapping")
      import :: c_int, c_ptr, c_int64_t
      integer(c_int), value :: num_procs
      integer(c_int), dimension(2), intent(in) :: dims
      integer(c_int64_t), value :: global_count
      type(c_ptr), value :: pmap
    end function
    subroutine icheck_pmap_free(pmap) bind(C, name="icheck_pmap_free")
      import :: c_ptr
      type(c_ptr), value :: pmap
    end subroutine
    integer(c_int) function c_add_adapt_global(label, local, local_count, type, global_count, distribution, &
        param, pmap) bind(C, name="icheck_add_adapt_global")
      import :: c_int, c_ptr, c_char, c_size_t, c_int64_t
      character(kind=c_char), dimension(*), intent(in) :: label
      type(c_ptr), value :: local
      integer(c_size_t), value :: local_count
      integer(c_int), value :: type, distribution
      integer(c_int64_t), value :: global_count, param
      type(c_ptr), value :: pmap
    end function
    integer(c_int64_t) function c_local_count(label) bind(C, name="icheck_local_count")
      import :: c_int64_t, c_char
      character(kind=c_char), dimension(*), intent(in) :: label
    end function
    integer(c_int) function c_redistribute(label, data, count) bind(C, name="icheck_redistribute")
      import :: c_int, c_ptr, c_char, c_size_t
      character(kind=c_char), dimension(*), intent(in) :: label
      type(c_ptr), value :: data
      integer(c_size_t), value :: count
    end function
    integer(c_size_t) function c_strlen(s) bind(C, name="strlen")
      import :: c_size_t, c_ptr
      type(c_ptr), value :: s
    end function
  end interface

contains

  ! config = "" uses $ICHECK_CONFIG, then /etc/icheck/icheck.toml.
  integer(c_int) function icheck_init(config, app_name, comm, status)
    character(len=*), intent(in) :: config, app_name
    integer, intent(in) :: comm
    integer, intent(out) :: status
    character(kind=c_char, len=len_trim(config) + 1), target :: c_config
    integer(c_int) :: c_status
    c_config = trim(config) // c_null_char
    if (len_trim(config) == 0) then
      icheck_init = c_init(c_null_ptr, trim(app_name) // c_null_char, int(comm, c_int), c_status)
    else
      icheck_init = c_init(c_loc(c_config), trim(app_name) // c_null_char, int(comm, c_int), c_status)
    end if
    status = c_status
  end function

  ! data: any contiguous array (or scalar) with the TARGET attribute.
  integer(c_int) function icheck_add(label, data, count, type)
    character(len=*), intent(in) :: label
    type(*), dimension(..), target :: data
    integer(c_size_t), intent(in) :: count
    integer(c_int), intent(in) :: type
    icheck_add = c_add(trim(label) // c_null_char, c_loc(data), count, type)
  end function

  integer(c_int) function icheck_restore(label, data, count)
    character(len=*), intent(in) :: label
    type(*), dimension(..), target :: data
    integer(c_size_t), intent(in) :: count
    icheck_restore = c_restore(trim(label) // c_null_char, c_loc(data), count)
  end function

  ! ICHECK_CONSTANT, ICHECK_SIZE or ICHECK_RANK.
  integer(c_int) function icheck_add_adapt(label, data, count, type, attribute)
    character(len=*), intent(in) :: label
    type(*), dimension(..), target :: data
    integer(c_size_t), intent(in) :: count
    integer(c_int), intent(in) :: type, attribute
    icheck_add_adapt = c_add_adapt(trim(label) // c_null_char, c_loc(data), count, type, attribute, &
                                   c_null_ptr, c_null_funptr, c_null_ptr)
  end function

  ! ICHECK_DEFAULT (joining = .false.) or ICHECK_DEFAULT_JOINING; default_value
  ! is one element of the label's type.
  integer(c_int) function icheck_add_adapt_default(label, data, count, type, default_value, joining)
    character(len=*), intent(in) :: label
    type(*), dimension(..), target :: data
    integer(c_size_t), intent(in) :: count
    integer(c_int), intent(in) :: type
    type(*), target :: default_value
    logical, intent(in) :: joining
    integer(c_int) :: attribute
    attribute = ICHECK_DEFAULT
    if (joining) attribute = ICHECK_DEFAULT_JOINING
    icheck_add_adapt_default = c_add_adapt(trim(label) // c_null_char, c_loc(data), count, type, attribute, &
                                           c_loc(default_value), c_null_funptr, c_null_ptr)
  end function

  ! ICHECK_VOLATILE: recalc = c_funloc of a bind(C) subroutine
  ! (data, count, old_size, size, rank, arg), all but data and arg by value.
  integer(c_int) function icheck_add_adapt_volatile(label, data, count, type, recalc, arg)
    character(len=*), intent(in) :: label
    type(*), dimension(..), target :: data
    integer(c_size_t), intent(in) :: count
    integer(c_int), intent(in) :: type
    type(c_funptr), intent(in) :: recalc
    type(c_ptr), intent(in) :: arg
    icheck_add_adapt_volatile = c_add_adapt(trim(label) // c_null_char, c_loc(data), count, type, &
                                            ICHECK_VOLATILE, c_null_ptr, recalc, arg)
  end function

  ! param: width (ICHECK_CYCLIC) or root (ICHECK_MANUAL); pmap from
  ! icheck_pmap_create for ICHECK_PREDEFINED, else c_null_ptr.
  integer(c_int) function icheck_add_adapt_global(label, local, local_count, type, global_count, &
                                                  distribution, param, pmap)
    character(len=*), intent(in) :: label
    type(*), dimension(..), target :: local
    integer(c_size_t), intent(in) :: local_count
    integer(c_int), intent(in) :: type, distribution
    integer(c_int64_t), intent(in) :: global_count, param
    type(c_ptr), intent(in) :: pmap
    icheck_add_adapt_global = c_add_adapt_global(trim(label) // c_null_char, c_loc(local), local_count, type, &
                                                 global_count, distribution, param, pmap)
  end function

  ! After icheck_restart: elements this process receives (< 0: an error code).
  integer(c_int64_t) function icheck_local_count(label)
    character(len=*), intent(in) :: label
    icheck_local_count = c_local_count(trim(label) // c_null_char)
  end function

  integer(c_int) function icheck_redistribute(label, data, count)
    character(len=*), intent(in) :: label
    type(*), dimension(..), target :: data
    integer(c_size_t), intent(in) :: count
    icheck_redistribute = c_redistribute(trim(label) // c_null_char, c_loc(data), count)
  end function

  integer(c_int) function icheck_probe_agents()
    icheck_probe_agents = c_probe(c_null_ptr)
  end function

  function icheck_strerror(code) result(text)
    integer(c_int), intent(in) :: code
    character(len=:), allocatable :: text
    character(kind=c_char), pointer :: chars(:)
    type(c_ptr) :: p
    integer :: i, n
    p = c_strerror(code)
    n = int(c_strlen(p))
    call c_f_pointer(p, chars, [n])
    allocate(character(len=n) :: text)
    do i = 1, n
      text(i:i) = chars(i)
    end do
  end function
end module icheck
