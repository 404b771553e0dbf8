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
  integer(c_int), parameter, public :: ICHECK_ERR_INTERNAL = -16
  integer(c_int), parameter, public :: ICHECK_CHAR = 1, ICHECK_INT = 2, ICHECK_LONG = 3
  integer(c_int), parameter, public :: ICHECK_FLOAT = 4, ICHECK_DOUBLE = 5, ICHECK_BINARY = 6
  ! Fortran names are case-insensitive, so the C constant ICHECK_RESTART would
  ! clash with the function icheck_restart: here it is ICHECK_RESTARTING.
  integer(c_int), parameter, public :: ICHECK_FRESH = 0, ICHECK_RESTARTING = 1
  integer(c_int), parameter, public :: IC_CLEANUP = 0, IC_PERSIST = 1

  public :: icheck_init, icheck_add, icheck_commit, icheck_enable_asynchronous, icheck_wait
  public :: icheck_restart, icheck_restore, icheck_restart_all, icheck_probe_agents
  public :: icheck_finalize, icheck_strerror

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
    integer(c_int) function icheck_finalize(mode) bind(C, name="icheck_finalize")
      import :: c_int
      integer(c_int), value :: mode
    end function
    type(c_ptr) function c_strerror(code) bind(C, name="icheck_strerror")
      import :: c_int, c_ptr
      integer(c_int), value :: code
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
