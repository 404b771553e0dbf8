! adapt: the malleability API from Fortran. A run with no checkpoint
! commits a BLOCK-distributed array (global index + 0.5 in every element), a
! CYCLIC (width 2) integer array and the process count (SIZE); a later run
! with any other process count restores its parts and checks every element.
!
!   mpifort adapt.f90 -o adapt $(pkg-config --cflags --libs icheck)
!   mpirun -np 4 ./adapt     # prints "FORTRAN COMMITTED ranks=4"
!   mpirun -np 3 ./adapt     # prints "FORTRAN VERIFIED from=4 ranks=3"
program adapt
  use mpi
  use icheck
  use, intrinsic :: iso_c_binding
  implicit none
  integer(c_int64_t), parameter :: nglobal = 10007
  integer :: ierr, rank, nranks, status, bad, i
  integer(c_int) :: rc
  integer(c_int64_t) :: first, count, k, g
  real(c_double), allocatable, target :: x(:)
  integer(c_int), allocatable, target :: y(:)
  integer(c_int), target :: procs

  call MPI_Init(ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks, ierr)
  rc = icheck_init("", "fortran-adapt", MPI_COMM_WORLD, status)
  call check(rc, "icheck_init")

  if (status == ICHECK_FRESH) then
    ! BLOCK: the first mod(n, p) ranks hold one element more.
    count = nglobal / nranks
    first = rank * count + min(int(rank, c_int64_t), mod(nglobal, int(nranks, c_int64_t)))
    if (rank < mod(nglobal, int(nranks, c_int64_t))) count = count + 1
    allocate(x(count))
    do k = 1, count
      x(k) = real(first + k - 1, c_double) + 0.5d0
    end do
    ! CYCLIC width 2: blocks of two dealt round robin.
    allocate(y(cyclic_count(rank, nranks)))
    i = 0
    do g = 0, nglobal - 1
      if (mod(g / 2, int(nranks, c_int64_t)) == rank) then
        i = i + 1
        y(i) = int(g * 3, c_int)
      end if
    end do
    procs = nranks
    call add_labels()
    rc = icheck_commit()
    call check(rc, "icheck_commit")
    if (rank == 0) print '(a,i0)', "FORTRAN COMMITTED ranks=", nranks
    rc = icheck_finalize(IC_PERSIST)
    call check(rc, "icheck_finalize")
  else
    rc = icheck_restart()
    call check(rc, "icheck_restart")
    count = icheck_local_count("x")
    if (count < 0) call check(int(count, c_int), "icheck_local_count")
    allocate(x(count))
    allocate(y(icheck_local_count("y")))
    procs = -1
    call add_labels()
    rc = icheck_restore("x", x, size(x, kind=c_size_t))
    call check(rc, "icheck_restore x")
    rc = icheck_restore("y", y, size(y, kind=c_size_t))
    call check(rc, "icheck_restore y")
    rc = icheck_restore("procs", procs, 1_c_size_t)
    call check(rc, "icheck_restore procs")
    bad = 0
    first = rank * (nglobal / nranks) + min(int(rank, c_int64_t), mod(nglobal, int(nranks, c_int64_t)))
    do k = 1, size(x, kind=c_int64_t)
      if (x(k) /= real(first + k - 1, c_double) + 0.5d0) bad = bad + 1
    end do
    i = 0
    do g = 0, nglobal - 1
      if (mod(g / 2, int(nranks, c_int64_t)) == rank) then
        i = i + 1
        if (y(i) /= int(g * 3, c_int)) bad = bad + 1
      end if
    end do
    if (procs /= nranks) bad = bad + 1
    call MPI_Allreduce(MPI_IN_PLACE, bad, 1, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD, ierr)
    if (bad /= 0) then
      if (rank == 0) print '(a,i0)', "FORTRAN WRONG elements=", bad
      call MPI_Abort(MPI_COMM_WORLD, 1, ierr)
    end if
    if (rank == 0) print '(a,i0)', "FORTRAN VERIFIED ranks=", nranks
    rc = icheck_finalize(IC_CLEANUP)
    call check(rc, "icheck_finalize")
  end if
  call MPI_Finalize(ierr)

contains

  ! The same labels in both runs: x (BLOCK), y (CYCLIC, width 2), procs (SIZE).
  subroutine add_labels()
    integer(c_int) :: code
    code = icheck_add_adapt_global("x", x, size(x, kind=c_size_t), ICHECK_DOUBLE, nglobal, ICHECK_BLOCK, &
                                   0_c_int64_t, c_null_ptr)
    call check(code, "icheck_add_adapt_global x")
    code = icheck_add_adapt_global("y", y, size(y, kind=c_size_t), ICHECK_INT, nglobal, ICHECK_CYCLIC, &
                                   2_c_int64_t, c_null_ptr)
    call check(code, "icheck_add_adapt_global y")
    code = icheck_add_adapt("procs", procs, 1_c_size_t, ICHECK_INT, ICHECK_SIZE)
    call check(code, "icheck_add_adapt")
  end subroutine

  integer function cyclic_count(r, p)
    integer, intent(in) :: r, p
    integer(c_int64_t) :: gg
    cyclic_count = 0
    do gg = 0, nglobal - 1
      if (mod(gg / 2, int(p, c_int64_t)) == r) cyclic_count = cyclic_count + 1
    end do
  end function

  subroutine check(code, what)
    integer(c_int), intent(in) :: code
    character(len=*), intent(in) :: what
    integer :: e
    if (code < 0) then
      print '(a,a,a,a)', what, " failed: ", icheck_strerror(code)
      call MPI_Abort(MPI_COMM_WORLD, 1, e)
    end if
  end subroutine
end program adapt
