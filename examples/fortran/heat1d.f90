! heat1d: 1-D heat diffusion in Fortran with icheck checkpoint/restart.
!
! Each rank owns `n` cells of a rod (halo cells exchanged with neighbours);
! the left end is held at 100 degrees. Every `every` iterations the cells
! and the iteration number are committed; a restarted run continues from the
! newest complete version. Rank 0 prints a checksum of the whole rod.
!
!   mpifort heat1d.f90 -o heat1d $(pkg-config --cflags --libs icheck)
!   mpirun -np 4 ./heat1d 4096 300 50 [fail_at]
program heat1d
  use mpi
  use icheck
  use, intrinsic :: iso_c_binding
  implicit none
  integer :: ierr, rank, nranks, status, left, right, i
  integer(c_int) :: rc
  integer :: n, iters, every, fail_at
  integer(c_long), target :: iter
  real(c_double), allocatable, target :: u(:), v(:)
  real(c_double) :: local, total
  character(len=32) :: arg

  call MPI_Init(ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks, ierr)
  n = 1024; iters = 200; every = 25; fail_at = -1
  if (command_argument_count() >= 3) then
    call get_command_argument(1, arg); read(arg, *) n
    call get_command_argument(2, arg); read(arg, *) iters
    call get_command_argument(3, arg); read(arg, *) every
  end if
  if (command_argument_count() >= 4) then
    call get_command_argument(4, arg); read(arg, *) fail_at
  end if
  allocate(u(0:n+1), v(0:n+1))
  u = 0.0d0; v = 0.0d0
  left = merge(MPI_PROC_NULL, rank - 1, rank == 0)
  right = merge(MPI_PROC_NULL, rank + 1, rank == nranks - 1)
  if (rank == 0) u(0) = 100.0d0

  iter = 0
  rc = icheck_init("", "heat1d", MPI_COMM_WORLD, status)
  call check(rc, "icheck_init")
  rc = icheck_add("rod", u(1:n), int(n, c_size_t), ICHECK_DOUBLE)
  call check(rc, "icheck_add(rod)")
  rc = icheck_add("iter", iter, 1_c_size_t, ICHECK_LONG)
  call check(rc, "icheck_add(iter)")
  if (status == ICHECK_RESTARTING) then
    call check(icheck_restart(), "icheck_restart")
    call check(icheck_restore("rod", u(1:n), int(n, c_size_t)), "icheck_restore(rod)")
    call check(icheck_restore("iter", iter, 1_c_size_t), "icheck_restore(iter)")
    if (rank == 0) print '(a,i0)', "RESTARTED at iteration ", iter
    iter = iter + 1
  else
    if (rank == 0) print '(a)', "FRESH start"
  end if

  do while (iter <= iters)
    call MPI_Sendrecv(u(1), 1, MPI_DOUBLE_PRECISION, left, 0, u(n+1), 1, MPI_DOUBLE_PRECISION, right, 0, &
                      MPI_COMM_WORLD, MPI_STATUS_IGNORE, ierr)
    call MPI_Sendrecv(u(n), 1, MPI_DOUBLE_PRECISION, right, 1, u(0), 1, MPI_DOUBLE_PRECISION, left, 1, &
                      MPI_COMM_WORLD, MPI_STATUS_IGNORE, ierr)
    if (rank == 0) u(0) = 100.0d0
    do i = 1, n
      v(i) = 0.5d0 * u(i) + 0.25d0 * (u(i-1) + u(i+1))
    end do
    u(1:n) = v(1:n)
    if (mod(iter, int(every, c_long)) == 0) then
      call check(icheck_commit(), "icheck_commit")
      if (rank == 0) print '(a,i0)', "COMMITTED iteration ", iter
    end if
    if (iter == fail_at .and. rank == 0) then
      print '(a,i0)', "FAULT injected at iteration ", iter
      flush(6)
      call abort()
    end if
    iter = iter + 1
  end do

  local = 0.0d0
  do i = 1, n
    local = local + u(i) * dble(rank * n + i)
  end do
  call MPI_Reduce(local, total, 1, MPI_DOUBLE_PRECISION, MPI_SUM, 0, MPI_COMM_WORLD, ierr)
  if (rank == 0) print '(a,es24.17)', "CHECKSUM ", total
  call check(icheck_finalize(IC_CLEANUP), "icheck_finalize")
  call MPI_Finalize(ierr)

contains

  subroutine check(code, what)
    integer(c_int), intent(in) :: code
    character(len=*), intent(in) :: what
    integer :: ierr2
    if (code < 0) then
      print '(a,i0,a,a,a,a)', "rank ", rank, ": ", what, " failed: ", icheck_strerror(code)
      call MPI_Abort(MPI_COMM_WORLD, 1, ierr2)
    end if
  end subroutine
end program heat1d
